"""The heads' held-out acceptance as the checkpoint's prior (`spec_prior.json`,
pipeline.model.spec_prior): measured by decoding held-out prompts at a fixed gamma with the
engine, per task, so that runs on this checkpoint plan from evidence instead of calibrating."""
from __future__ import annotations

from pathlib import Path

from pipeline.demo.tasks import TEMPLATES
from pipeline.model.spec_prior import write_spec_prior


def task_of(prompt: str) -> str:
    """The demo task whose template the prompt follows ("complete" has no marker of its own)."""
    for task, template in TEMPLATES.items():
        head = template.split("{text}")[0]
        if head and prompt.startswith(head):
            return task
    return "complete"


def measure_counts(engine, prompts: list[str], gamma: int, max_new_tokens: int) -> tuple[list[int], list[int]]:
    """Per-depth (reached, accepted) of greedy decoding `prompts` at `gamma`."""
    from pipeline.engine import SamplingParams

    engine.reset_stats()
    engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), gamma=gamma)
    return list(engine.stats.reached), list(engine.stats.accepted)


def write_heldout_prior(model_dir, prompts: list[str], gamma: int = 5, max_new_tokens: int = 64,
                        per_task: int = 32, device: str = "cpu", log=print) -> Path:
    """Measure the checkpoint's heads on up to `per_task` held-out prompts of each task and write
    `model_dir/spec_prior.json`."""
    from pipeline.engine import Engine

    engine = Engine.from_pretrained(str(model_dir), device=device, dtype="float32", max_batch_size=32, gamma_max=gamma)
    by_task: dict[str, list[str]] = {}
    for p in prompts:
        by_task.setdefault(task_of(p), []).append(p)
    counts = {t: measure_counts(engine, ps[:per_task], gamma, max_new_tokens) for t, ps in sorted(by_task.items())}
    path = write_spec_prior(model_dir, counts, f"held-out acceptance at gamma {gamma}, greedy, "
                                               f"{max_new_tokens} new tokens (pipeline.demo.prior)", gamma)
    log(f"acceptance prior written to {path}")
    return path


def write_eval_prior(model_dir, evaluated: dict) -> Path:
    """`spec_prior.json` from evaluate_acceptance's result (it carries per-task counts)."""
    counts = {t: (r["reached"], r["accepted"]) for t, r in evaluated.items() if r.get("reached")}
    gamma = max((r.get("gamma", 0) for r in evaluated.values()), default=0)
    return write_spec_prior(model_dir, counts, f"held-out acceptance at gamma {gamma}, greedy "
                                               "(pipeline.demo.evaluate)", gamma)
