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

from pipeline.engine.verify import uniform_verify
from pipeline.model import native
from pipeline.model.cache import KVCache
from pipeline.spec_decode.acceptance import greedy_accept
from pipeline.spec_decode.stats import StepRecord


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
    a step runs: `uniform_verify`), and drafts of gamma tokens by every
    draft source the checkpoint has, at a few batch sizes (`rows_list`, default
    `rows_grid(max_rows)`) and two context lengths. Takes well under a second for small models
    on a CPU."""
    cfg, dev, dt = engine.config, engine.device, engine.dtype
    contexts = sorted({max(1, context_len // 2), context_len * 2})
    capacity = max(contexts) + gamma_max + 2
    cache = KVCache(cfg.num_layers, max_rows, capacity, cfg.num_kv_heads, cfg.head_dim, dt, dev)
    sources = list(engine.draft_sources(max_rows, capacity) or ())
    gen = torch.Generator(device="cpu").manual_seed(0)
    records = []

    def timed(fn) -> float:
        fn()                                   # warm-up (allocator, kernels)
        sync(dev)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync(dev)
            best = min(best, time.perf_counter() - t0)
        return best

    for ctx in contexts:
        for rows in rows_list or rows_grid(max_rows):
            for gamma in range(gamma_max + 1):
                tokens = torch.randint(0, cfg.vocab_size, (rows, gamma + 1), generator=gen).to(dev)
                lengths = torch.full((rows,), ctx, device=dev)

                def verify():                  # a greedy step's verify and acceptance, as the engine runs them
                    _, logits, _ = uniform_verify(engine.target, cache, tokens[:, 0], tokens[:, 1:], lengths)
                    num_acc, emitted = greedy_accept(tokens[:, 1:], logits, native.argmax)
                    return num_acc.tolist(), emitted.tolist()

                v = timed(verify)
                cost = {"depth": 0.0, "row": 0.0}
                for source in sources:         # a per-row cost does not grow with gamma: timed once
                    if gamma and (source.cost_per == "depth" or gamma == gamma_max):
                        cost[source.cost_per] += timed(source.probe(rows, gamma, ctx))
                records.append(StepRecord(gamma, rows, gamma + 1, float(ctx), v, cost["depth"] + cost["row"], 0,
                                          lookup_s=cost["row"]))
    return records


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
