"""Acceptance of a checkpoint's MTP heads on the demo dataset's held-out rows, per task.

Decoding with the engine at a fixed gamma (greedy unless told a temperature and verification
rule); reports per-depth acceptance a_k, mean acceptance length (accepted + 1 per verify step
per row) and a few outputs next to references.
"""
from __future__ import annotations

import random
import re
import time
from pathlib import Path

from pipeline.demo.tasks import TASKS

# Words that say nothing about which function a summary is about.
_GENERIC = set("""a an the and or of to in on for from with by as at is are be it its this that
these those if else not no return returns returned given new value values object objects self
true false none get set use used using all any each one two into than then which when""".split())


def content_words(text: str) -> set[str]:
    """Lower-case words of 3+ letters, identifiers split at '_' and camelCase, generic words out."""
    parts = re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", text)
    return {w.lower() for w in parts if len(w) >= 3} - _GENERIC


def on_topic_rate(generated: list[str], references: list[str], seed: int = 0) -> dict:
    """Share of summaries with a content word in common with their own reference, and the same
    for a shuffled pairing (each summary against another row's reference): the chance level."""
    gen = [content_words(g) for g in generated]
    ref = [content_words(r) for r in references]
    own = sum(bool(g & r) for g, r in zip(gen, ref)) / max(len(gen), 1)
    perm = list(range(len(ref)))
    random.Random(seed).shuffle(perm)
    shuffled = sum(bool(g & ref[j]) for g, j in zip(gen, perm)) / max(len(gen), 1)
    return {"shares_word_with_reference": round(own, 3), "shuffled_pairs": round(shuffled, 3)}


def load_rows(data_path: Path, task: str, limit: int) -> list[dict]:
    import pyarrow.parquet as pq
    rows = [r for r in pq.read_table(str(data_path)).to_pylist() if r["task"] == task]
    return rows[:limit]


def evaluate_acceptance(model_dir: Path, data_path: Path, gamma: int = 3, rows_per_task: int = 64,
                        max_new_tokens: int = 64, examples: int = 10, device: str = "cpu",
                        log=print, temperature: float = 0.0, verify: str = "coupled", seed: int = 0) -> dict:
    """{task: {acceptance_by_depth, mean_acceptance_length, rows, seconds, examples}}."""
    from pipeline.engine import Engine, SamplingParams

    engine = Engine.from_pretrained(str(model_dir), device=device, dtype="float32", max_batch_size=32)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, verify=verify, seed=seed)
    out = {}
    for task in TASKS:
        rows = load_rows(data_path, task, rows_per_task)
        engine.reset_stats()
        t = time.time()
        outs = engine.generate([r["prompt"] for r in rows], params, gamma=gamma)
        stats = engine.stats
        out[task] = {
            "gamma": gamma,
            "rows": len(rows),
            "acceptance_by_depth": [round(a, 3) for a in stats.acceptance_by_depth()],
            "mean_acceptance_length": round(stats.mean_acceptance_length(), 3),
            "reached": list(stats.reached), "accepted": list(stats.accepted),     # counts, for spec_prior.json
            "seconds": round(time.time() - t, 1),
            "on_topic": on_topic_rate([o.text for o in outs], [r["reference"] for r in rows])
                        if task == "summarize" else None,
            "examples": [{"qualname": f"{r['module']}.{r['qualname']}", "generated": o.text,
                          "reference": r["reference"]} for r, o in zip(rows[:examples], outs)],
        }
        log(f"{task}: a_k={out[task]['acceptance_by_depth']} "
            f"mean acceptance length={out[task]['mean_acceptance_length']}"
            + (f" on_topic={out[task]['on_topic']}" if out[task]["on_topic"] else ""))
    return out


def main(cfg) -> int:
    """Hydra recipe: evaluate `model.path` on `data.path` (keys under `eval:`)."""
    import json

    from omegaconf import OmegaConf
    opts = OmegaConf.to_container(cfg.get("eval", {}) or {}, resolve=True)
    result = evaluate_acceptance(Path(cfg.model.path), Path(cfg.data.path), **opts)
    print(json.dumps(result, indent=2))
    return 0
