"""A short cost profile of the accelerator: timed verify forwards and drafts at several batch
shapes, recorded as StepRecords so the cost model fits them like real steps.

Drafts are timed through the engine's own draft sources (`Engine.draft_sources`, each one's
`probe`), not a sketch of them: the profile is all the cost model knows of drafting until the
engine speculates, and after a long run of plain decoding the fit window holds no drafted step
to correct it (docs/decisions.md, 2026-11-29). The heads are timed per depth (each head's fill
over the gamma + 1 tokens a step accepts at most, then gamma depths with their logits); a
host-side source (the n-gram lookup) once per batch size and context, at gamma_max, its time
in `lookup_s` (part of draft_s)."""
from __future__ import annotations

import time

import torch

from pipeline.engine.verify import greedy_verify
from pipeline.model.cache import KVCache
from pipeline.spec_decode.stats import StepRecord


MAX_REPS = 8            # timings of a cheap shape at most (the least is kept) ...
SHAPE_BUDGET_S = 0.01   # ... as many as fit this many seconds. On a shared CPU two timings of a
                        # one-row verify read 0.94-1.08 ms (1 token) and 1.0-1.2 (2 tokens) where
                        # eight read 0.64-0.68 and 0.81-0.87, as steps run back to back do


def rows_grid(max_rows: int) -> list[int]:
    grid, r = [], 1
    while r < max_rows:
        grid.append(r)
        r *= 4
    return grid + [max_rows]


@torch.inference_mode()
def profile_costs(engine, max_rows: int, gamma_max: int, context_len: int = 128, reps: int = 2,
                  rows_list: list[int] | None = None) -> list[StepRecord]:
    """Time verify steps of rows x (gamma + 1) tokens (the forward, logits and greedy acceptance
    a step runs: `greedy_verify`), and drafts of gamma tokens by every
    draft source the checkpoint has, at a few batch sizes (`rows_list`, default
    `rows_grid(max_rows)`) and two context lengths. Each is the least of `reps` timings, or of up
    to MAX_REPS for a shape that fits them in SHAPE_BUDGET_S. Takes a few seconds for the demo
    model on a CPU."""
    cfg, dev, dt = engine.config, engine.device, engine.dtype
    contexts = sorted({max(1, context_len // 2), context_len * 2})
    capacity = max(contexts) + gamma_max + 2
    cache = KVCache(cfg.num_layers, max_rows, capacity, cfg.num_kv_heads, cfg.head_dim, dt, dev)
    sources = list(engine.draft_sources(max_rows, capacity) or ())
    gen = torch.Generator(device="cpu").manual_seed(0)
    records = []

    for ctx in contexts:
        for rows in rows_list or rows_grid(max_rows):
            for gamma in range(gamma_max + 1):
                tokens = torch.randint(0, cfg.vocab_size, (rows, gamma + 1), generator=gen).to(dev)
                lengths = torch.full((rows,), ctx, device=dev)

                def verify():                  # a greedy step's verify and acceptance, as the engine runs them
                    _, num_acc, emitted = greedy_verify(engine.target, cache, tokens[:, 0], tokens[:, 1:], lengths)
                    return num_acc.tolist(), emitted.tolist()

                v = least_time(verify, reps, dev)
                cost = {"depth": 0.0, "row": 0.0}
                for source in sources:         # a per-row cost does not grow with gamma: timed once
                    if gamma and (source.cost_per == "depth" or gamma == gamma_max):
                        cost[source.cost_per] += least_time(source.probe(rows, gamma, ctx), reps, dev)
                records.append(StepRecord(gamma, rows, gamma + 1, float(ctx), v, cost["depth"] + cost["row"], 0,
                                          lookup_s=cost["row"]))
    return records


def least_time(fn, reps: int, device) -> float:
    """The least of `reps` timings of `fn` after an untimed run (allocator, kernels), or of up
    to MAX_REPS where they fit SHAPE_BUDGET_S (judged by the first timing): noise on a shared
    machine only adds time, and a sub-millisecond shape needs more tries to see its own.
    Example: a 1 ms verify is timed 8 times, a 6 ms one twice."""
    fn()
    sync(device)
    best, runs, i = float("inf"), reps, 0
    while i < runs:
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
        if i == 0:
            runs = max(reps, min(MAX_REPS, int(SHAPE_BUDGET_S / max(best, 1e-9))))
        i += 1
    return best


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
