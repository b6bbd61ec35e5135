"""`spec_prior.json`: the MTP heads' held-out acceptance, shipped in the checkpoint directory.

Written by the job that trains the heads (and build_demo), read by the engine and the driver so
that a run starts from evidence instead of calibrating. Per task (and "*" for all tasks
pooled), per-depth counts: `reached[k-1]` row-steps verified draft k with drafts 1..k-1
accepted, `accepted[k-1]` of them accepted it (a_k = accepted / reached). Counts, not ratios,
so a reader knows how much evidence it is.

    {"format": 1, "source": "held-out acceptance ...", "gamma": 5,
     "tasks": {"summarize": {"reached": [640, 420], "accepted": [420, 300]}, "*": {...}}}
"""
from __future__ import annotations

import json
from pathlib import Path

FILE = "spec_prior.json"

Counts = tuple[list[int], list[int]]


def pooled(tasks: dict[str, Counts]) -> Counts:
    """Every task's counts summed per depth."""
    depth = max((len(r) for r, _ in tasks.values()), default=0)
    reached, accepted = [0] * depth, [0] * depth
    for r, a in tasks.values():
        for k in range(len(r)):
            reached[k] += int(r[k])
            accepted[k] += int(a[k])
    return reached, accepted


def write_spec_prior(model_dir, tasks: dict[str, Counts], source: str, gamma: int) -> Path:
    """Write `model_dir/spec_prior.json` from per-task (reached, accepted) counts."""
    tasks = {k: v for k, v in tasks.items() if k != "*"}
    body = {"format": 1, "source": source, "gamma": gamma,
            "tasks": {name: {"reached": list(map(int, r)), "accepted": list(map(int, a)),
                             "acceptance_by_depth": [round(x / y, 3) if y else None for x, y in zip(a, r)]}
                      for name, (r, a) in {**tasks, "*": pooled(tasks)}.items()}}
    path = Path(model_dir) / FILE
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path


def read_spec_prior(path) -> dict[str, Counts] | None:
    """task -> (reached, accepted) from a checkpoint directory's (or a path to a) spec_prior.json,
    "*" included; None when there is none or it cannot be read."""
    p = Path(path)
    p = p / FILE if p.is_dir() else p
    try:
        body = json.loads(p.read_text())
        tasks = {name: (list(map(int, t["reached"])), list(map(int, t["accepted"])))
                 for name, t in body["tasks"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if "*" not in tasks and tasks:
        tasks["*"] = pooled(tasks)
    return tasks
