"""The demo's MTP training prompts: its task prompts over the stdlib functions (`mtp.prompt_source: stdlib`)."""
from __future__ import annotations

import random


def stdlib_prompts(records, spec) -> tuple[list[str], list[str]]:
    """Demo prompts: training-split functions to train on, held-out ones to report on.
    `spec`: a pipeline.training.train_mtp.MTPTrainSpec (num_prompts, num_eval, seed, task_shares)."""
    return (_prompts(records, False, spec.num_prompts, spec.seed, spec.task_shares),
            _prompts(records, True, spec.num_eval, spec.seed))


def _prompts(records, heldout: bool, n: int, seed: int, shares: dict | None = None) -> list[str]:
    """About n prompts, `shares[task]` of them per task (equal shares by default; the split
    itself has twice as many json rows as either other task)."""
    from pipeline.demo.tasks import TASKS, prompt_for, task_pairs
    shares = shares or {t: 1 / len(TASKS) for t in TASKS}
    by_task = {t: [] for t in TASKS}
    for r in records:
        if r.heldout == heldout:
            for t, x, _ in task_pairs(r):
                by_task[t].append(prompt_for(t, x))
    ps = []
    for t in TASKS:
        random.Random(f"{seed}-{t}").shuffle(by_task[t])
        ps += by_task[t][: round(n * shares.get(t, 0.0) / sum(shares.values()))]
    random.Random(seed).shuffle(ps)
    return ps
