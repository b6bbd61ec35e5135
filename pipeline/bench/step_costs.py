"""Step-cost ratios of a checkpoint: verify(q) / verify(1), and what one draft depth costs
against a gamma-0 step, at a few batch sizes and contexts.

verify(q): one target forward of rows x q tokens at context `ctx`, its output projection, argmax
and greedy acceptance, as the engine's greedy verify step runs it (pipeline.engine.verify
`greedy_verify`). Drafting is timed through the engine's own draft
sources (`Engine.draft_sources`, each one's `probe`): draft(g), a source costed per depth (the
heads) proposing g tokens (the fill over g + 1 accepted tokens, then g depths); the depth cost
is the slope (draft(g) - draft(1)) / (g - 1) and draft(1) is reported apart (it holds the fill);
lookup, a source costed per row (the n-gram lookup), per row at the largest g. Medians of
`reps` timings, each after a warm-up; every shape runs once per repetition, in the
interleaved order of pipeline.bench.repeat, so a shared machine's drift hits all shapes alike
and the ratios hold where the absolute times swing.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from pipeline.engine.verify import greedy_verify
from pipeline.model.cache import KVCache


@dataclass
class StepCosts:
    rows: int
    ctx: int
    verify_s: dict          # q -> seconds
    draft_s: dict           # gamma -> seconds of the sources costed per depth (empty without heads)
    lookup_row_s: dict = field(default_factory=dict)   # source costed per row -> seconds per row

    def verify_ratio(self, q: int) -> float:
        return self.verify_s[q] / self.verify_s[1]

    def depth_s(self) -> float | None:
        """Marginal seconds of one more draft depth (slope over gamma 1..max)."""
        g = sorted(self.draft_s)
        if len(g) < 2:
            return None
        return (self.draft_s[g[-1]] - self.draft_s[g[0]]) / (g[-1] - g[0])


def median_times(fns: dict, reps: int, device, stat=statistics.median, clock=time.perf_counter) -> dict:
    """name -> median (or `stat`, e.g. min) seconds of fns[name](), interleaved over `reps`
    repetitions. `clock`: time.perf_counter (wall), or time.thread_time on a CPU run with one
    torch thread: the thread's own CPU time leaves out what other processes of a shared machine
    took while it waited (but not what they do to its caches).
    Each repetition runs fns in a shuffled order (seeded by the repetition): a millisecond
    function right after itself finds its weights in cache, and the palindromic `run_order`
    gave that to the first and last fns in every other repetition, so of two identical engines
    the one listed first read 5-8% faster steps (docs/decisions.md, stop 52)."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()                                   # warm-up (allocator, kernels)
    _sync(device)
    names = list(fns)
    for rep in range(reps):
        for name in random.Random(rep).sample(names, len(names)):
            t0 = clock()
            fns[name]()
            _sync(device)
            times[name].append(clock() - t0)
    return {name: stat(ts) for name, ts in times.items()}


@torch.inference_mode()
def measure(engine, rows: int, ctx: int, q_max: int = 6, reps: int = 21, draft_gammas=(1, 3, 5),
            stat=statistics.median, clock=time.perf_counter) -> StepCosts:
    return measure_many({"": engine}, rows, ctx, q_max, reps, draft_gammas, stat, clock)[""]


@torch.inference_mode()
def measure_many(engines: dict, rows: int, ctx: int, q_max: int = 6, reps: int = 21,
                 draft_gammas=(1, 3, 5), stat=statistics.median, clock=time.perf_counter) -> dict:
    """name -> StepCosts for several engines, every shape of every engine interleaved in one
    loop (paired: a shared machine's swings hit all of them alike)."""
    fns = {}
    for name, engine in engines.items():
        cfg, dev, dt = engine.config, engine.device, engine.dtype
        capacity = ctx + q_max + 2
        cache = KVCache(cfg.num_layers, rows, capacity, cfg.num_kv_heads, cfg.head_dim, dt, dev)
        gen = torch.Generator().manual_seed(0)
        fns.update({(name, "v", q): _verify_fn(engine, cache, rows, ctx, q, gen) for q in range(1, q_max + 1)})
        for source in engine.draft_sources(rows, capacity) or ():
            if source.cost_per == "depth":
                fns.update({(name, "d", g): source.probe(rows, g, ctx) for g in draft_gammas})
            else:
                fns[(name, "l", source.name)] = source.probe(rows, max(draft_gammas), ctx)
    t = median_times(fns, reps, next(iter(engines.values())).device, stat, clock)
    return {name: StepCosts(rows, ctx, {k[2]: v for k, v in t.items() if k[:2] == (name, "v")},
                            {k[2]: v for k, v in t.items() if k[:2] == (name, "d")},
                            {k[2]: v / rows for k, v in t.items() if k[:2] == (name, "l")}) for name in engines}


def baseline_engine(model, device: str):
    """The checkpoint without this branch's step changes: unpacked linears, rotary per forward,
    full-vocabulary drafts (RMSNorm's fused call gives the same bits and stays)."""
    from unittest import mock

    from pipeline.engine import Engine
    with mock.patch("pipeline.model.loader.packing_pays", lambda _: False):
        engine = Engine.from_pretrained(model, device=device)
    engine.target.rope_table = False
    for head in engine.heads:
        head.set_draft_vocab(None)
    return engine


def _verify_fn(engine, cache, rows: int, ctx: int, q: int, gen):
    dev = engine.device
    tokens = torch.randint(0, engine.config.vocab_size, (rows, q), generator=gen).to(dev)
    lengths = torch.full((rows,), ctx, device=dev)

    def step():
        return greedy_verify(engine.target, cache, tokens[:, 0], tokens[:, 1:], lengths)
    return step


def table(results: list[StepCosts], names: list[str] | None = None) -> str:
    """Markdown: one line per (rows, ctx) (and engine, where `names` label them)."""
    qs = sorted(results[0].verify_s)
    head = (["engine"] if names else []) + ["rows", "ctx", "step ms"]
    head += [f"v({q})/v(1)" for q in qs[1:]] + ["draft(1)/step", "depth/step", "depth ms", "lookup us/row"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(results):
        step = r.verify_s[1]
        depth = r.depth_s()
        d1 = r.draft_s.get(1)
        cells = ([names[i]] if names else []) + [str(r.rows), str(r.ctx), f"{1e3 * step:.2f}"]
        cells += [f"{r.verify_ratio(q):.2f}" for q in qs[1:]]
        lookup = sum(r.lookup_row_s.values())
        cells += [f"{d1 / step:.2f}" if d1 else "-", f"{depth / step:.2f}" if depth else "-",
                  f"{1e3 * depth:.2f}" if depth else "-", f"{1e6 * lookup:.1f}" if lookup else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
