"""Acceptance of a checkpoint's MTP heads on the demo dataset's held-out rows, per task.

Greedy decoding with the engine at a fixed gamma; reports per-depth acceptance a_k, mean
acceptance length (accepted + 1 per verify step per row) and a few outputs next to references.
"""
from __future__ import annotations

import time
from pathlib import Path

from pipeline.demo.tasks import TASKS


def load_rows(data_path: Path, task: str, limit: int) -> list[dict]:
    import pyarrow.parquet as pq
    rows = [r for r in pq.read_table(str(data_path)).to_pylist() if r["task"] == task]
    return rows[:limit]


def evaluate_acceptance(model_dir: Path, data_path: Path, gamma: int = 3, rows_per_task: int = 64,
                        max_new_tokens: int = 64, examples: int = 10, device: str = "cpu",
                        log=print) -> dict:
    """{task: {acceptance_by_depth, mean_acceptance_length, rows, seconds, examples}}."""
    from pipeline.engine import Engine, SamplingParams

    engine = Engine.from_pretrained(str(model_dir), device=device, dtype="float32", max_batch_size=32)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
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
            "seconds": round(time.time() - t, 1),
            "examples": [{"qualname": f"{r['module']}.{r['qualname']}", "generated": o.text,
                          "reference": r["reference"]} for r, o in zip(rows[:examples], outs)],
        }
        log(f"{task}: a_k={out[task]['acceptance_by_depth']} "
            f"mean acceptance length={out[task]['mean_acceptance_length']}")
    return out


def main(cfg) -> int:
    """Hydra recipe: evaluate `model.path` on `data.path` (keys under `eval:`)."""
    import json

    from omegaconf import OmegaConf
    opts = OmegaConf.to_container(cfg.get("eval", {}) or {}, resolve=True)
    result = evaluate_acceptance(Path(cfg.model.path), Path(cfg.data.path), **opts)
    print(json.dumps(result, indent=2))
    return 0
