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
    tails, tail_match = plan.tail_len or [0] * n, plan.tail_match or [0] * n
    heads_len = [g - t if m else 0 for g, t, m in zip(lens, tails, mtp)]     # a heads row's own drafts
    groups: dict[str, tuple[list[int], list[int]]] = {}
    unreached = 0                          # tail drafts verified behind a rejected heads' draft
    for i, row in enumerate(rows):
        g, a = lens[i], acc_list[i]
        row.out.num_drafted_tokens += g
        row.out.num_accepted_tokens += a
        if g and mtp[i]:
            row.drafted_steps += 1
            row.first_hits += a > 0
        h = heads_len[i] if mtp[i] else g
        if h:
            lg, la = groups.setdefault("mtp" if mtp[i] else f"ngram:{match[i]}", ([], []))
            lg.append(h)
            la.append(min(a, h))
        if tails[i] and a >= h:            # the tail was reached: its own depths count from 1
            lg, la = groups.setdefault(f"ngram:{tail_match[i]}", ([], []))
            lg.append(tails[i])
            la.append(a - h)
        elif tails[i]:
            unreached += tails[i]
        emit(row, emitted_list[i][:a + 1])
    heads_rows = [i for i in range(n) if mtp[i] and lens[i]]
    stats.observe_ragged(lens, acc_list, heads_rows, depth_len=heads_len)
    for key, (lg, la) in groups.items():
        stats.observe_source(key.split(":")[0], lg, la, key)
    if unreached:
        stats.count_drafted("ngram", unreached)
