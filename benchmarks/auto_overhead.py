"""What `auto` pays over gamma 0 where it decodes mostly plainly (a large batch, a task whose
drafts do not pay): gamma 0 and auto on engines of their own over one model, alternating call by
call, each call's decode time split by phase, and the paired auto / gamma 0 ratio.

    python benchmarks/auto_overhead.py --task json --batch 32 --reps 8
    python benchmarks/auto_overhead.py --task summarize --batch 1 --trace

Phases (sums over a call's steps, milliseconds, medians over repetitions): verify, drafting, the
step's host work (choosing gamma, emitting, releasing finished rows) and the rest of the call
outside its steps' timers (admission, the cost model's records); the heads' prompt fills apart.
Rows above FEW_ROWS and at most FEW_ROWS are shown apart: the tail of a draining batch is where
auto may speculate. `--trace` also times the heads' callbacks and the policy's choice per call
(wrapped, which adds a little to both engines' host time). Greedy, the target's prefill left
out, as `+job=bench` does.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

import torch  # noqa: E402

from pipeline.bench.prompts import task_prompts  # noqa: E402
from pipeline.bench.repeat import paired, run_order, show_paired  # noqa: E402
from pipeline.bench.systems import run_engine  # noqa: E402
from pipeline.engine import Engine, SamplingParams  # noqa: E402
from pipeline.spec_decode.policy import FEW_ROWS  # noqa: E402

DEMO = ROOT / "pipeline" / "assets" / "demo"
TRACED = [("pipeline.engine.drafters.mtp", "MTPSource", ["after_verify", "skip", "drop_rows", "move_row"]),
          ("pipeline.spec_decode.policy", "GoodputPolicy", ["choose", "plain_stands"])]


def call_split(m, stats) -> dict:
    """One call's decode milliseconds by phase (module docstring)."""
    out = {}
    for part, steps in (("big", [s for s in stats.steps if s.rows > FEW_ROWS]),
                        ("tail", [s for s in stats.steps if s.rows <= FEW_ROWS])):
        out[f"{part} steps"] = len(steps)
        out[f"{part} speculative steps"] = sum(1 for s in steps if s.gamma)
        out[f"{part} verify"] = sum(s.verify_s for s in steps) * 1e3
        out[f"{part} drafting"] = sum(s.draft_s for s in steps) * 1e3
        out[f"{part} step host"] = sum(s.overhead_s for s in steps) * 1e3
    out["heads' prompt fills"] = sum(p.seconds for p in stats.prefills if not p.rows) * 1e3
    timed = sum(s.verify_s + s.draft_s + s.overhead_s for s in stats.steps) * 1e3
    out["outside steps"] = m.decode_s * 1e3 - timed - out["heads' prompt fills"]
    out["decode"] = m.decode_s * 1e3
    return out


def trace(times: dict) -> None:
    """Wrap TRACED methods so each call adds its seconds to times[name]."""
    import importlib

    for module, cls, names in TRACED:
        owner = getattr(importlib.import_module(module), cls)
        for name in names:
            def timed(*a, _f=getattr(owner, name), _k=f"{cls}.{name}", **kw):
                t0 = time.perf_counter()
                try:
                    return _f(*a, **kw)
                finally:
                    times[_k] += time.perf_counter() - t0
            setattr(owner, name, timed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEMO / "model")
    ap.add_argument("--data", type=Path, default=DEMO / "data" / "demo.parquet")
    ap.add_argument("--task", default="json")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=0, help="prompts a call (default: the batch, at least 8)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--warmups", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trace", action="store_true", help="also time the heads' callbacks and the policy's choice")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = Engine.from_pretrained(str(args.model), device="cpu", max_batch_size=args.batch)
    engines = {"gamma 0": base, "auto": Engine(base.model, base.tokenizer, max_batch_size=args.batch,
                                               gamma_max=base.gamma_max)}
    gammas = {"gamma 0": 0, "auto": "auto"}
    prompts = task_prompts(str(args.data), args.task, args.prompts or max(args.batch, 8), base.tokenizer)
    params = SamplingParams(max_new_tokens=args.new, temperature=0.0, seed=0)
    times: dict = collections.defaultdict(float)
    if args.trace:
        trace(times)
    speed = {name: [] for name in engines}
    split = {name: collections.defaultdict(list) for name in engines}
    for rep in range(args.warmups + args.reps):
        for name in run_order(list(engines), rep):
            times.clear()
            m = run_engine(engines[name], prompts, params, gammas[name], draft="mtp", task=args.task)
            if rep < args.warmups:
                continue
            speed[name].append(m.tokens_per_s)
            for k, v in call_split(m, engines[name].last_stats).items():
                split[name][k].append(v)
            for k, v in times.items():
                split[name][f"{k} (traced)"].append(v * 1e3)
    print(f"{args.task}, batch {args.batch}, {len(prompts)} prompts, {args.reps} repetitions, "
          f"{torch.get_num_threads()} torch thread(s)\n")
    print("| per call (ms; steps: counts) | gamma 0 | auto |\n|---|---|---|")
    for k in split["auto"]:
        g0 = split["gamma 0"].get(k)
        print(f"| {k} | {statistics.median(g0) if g0 else 0:.2f} | {statistics.median(split['auto'][k]):.2f} |")
    print(f"| decode tokens/s | {statistics.median(speed['gamma 0']):.0f} | {statistics.median(speed['auto']):.0f} |")
    print(f"\nauto / gamma 0, paired: {show_paired(paired(speed['auto'], speed['gamma 0']))}")


if __name__ == "__main__":
    main()
