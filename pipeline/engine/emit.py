"""After a verify step: each row's accepted tokens emitted, its counters and the step's stats
(per depth for the heads, per source and n-gram match length for every source)."""
from __future__ import annotations

from typing import Callable

from pipeline.spec_decode.stats import SpecStats


def emit_uniform(rows: list, stats: SpecStats, gamma: int, acc_list: list[int], emitted_list: list[list[int]],
                 emit: Callable) -> None:
    """Every row drafted `gamma` tokens with the heads (or none drafted)."""
    for row, acc, emitted in zip(rows, acc_list, emitted_list):
        row.out.num_drafted_tokens += gamma
        row.out.num_accepted_tokens += acc
        if gamma:
            row.drafted_steps += 1
            row.first_hits += acc > 0
        emit(row, emitted[:acc + 1])
    stats.observe_acceptance(gamma, acc_list)
    if gamma:
        stats.observe_source("mtp", [gamma] * len(acc_list), acc_list)


def emit_ragged(rows: list, stats: SpecStats, plan, acc_list: list[int], emitted_list: list[list[int]],
                emit: Callable) -> None:
    """Rows with their own draft counts and sources (a StepDrafts `plan`)."""
    n = len(rows)
    lens = plan.draft_len.tolist()
    mtp = plan.use_mtp.tolist() if plan.use_mtp is not None else [False] * n
    match = plan.match or [0] * n
    groups: dict[str, tuple[list[int], list[int]]] = {}
    for i, row in enumerate(rows):
        g = lens[i]
        row.out.num_drafted_tokens += g
        row.out.num_accepted_tokens += acc_list[i]
        if g and mtp[i]:
            row.drafted_steps += 1
            row.first_hits += acc_list[i] > 0
        if g:
            lg, la = groups.setdefault("mtp" if mtp[i] else f"ngram:{match[i]}", ([], []))
            lg.append(g)
            la.append(acc_list[i])
        emit(row, emitted_list[i][:acc_list[i] + 1])
    stats.observe_ragged(lens, acc_list, [i for i in range(n) if mtp[i] and lens[i]])
    for key, (lg, la) in groups.items():
        stats.observe_source(key.split(":")[0], lg, la, key)
