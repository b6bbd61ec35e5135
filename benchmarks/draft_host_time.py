"""Host time of choosing a step's drafts (n-gram lookup and per-row choice), per step, real clock.

    python benchmarks/draft_host_time.py --task json --draft ngram --batch 1
    python benchmarks/draft_host_time.py --task complete --draft auto --batch 48

Runs the draft-sources benchmark's setup (the task's n-gram index from --index-rows other rows,
a warm-up call), then --calls timed calls of `draft=...` on the cell's prompts, with the
planner's parts wrapped in timers. Prints microseconds per step and per call of each part; the
model forwards are not in any of them. Compare commits by running each tree's copy of this
script back to back (it puts its own tree first on sys.path).
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

import torch  # noqa: E402

import pipeline.engine.drafters.ngram as ngram  # noqa: E402
import pipeline.engine.drafting as drafting  # noqa: E402
from pipeline.bench import runner  # noqa: E402

DEMO = ROOT / "pipeline" / "assets" / "demo"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="json")
    ap.add_argument("--draft", default="ngram", choices=["ngram", "auto"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--index-rows", type=int, default=120)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    spec = runner.BenchSpec(model_path=str(DEMO / "model"), data_path=str(DEMO / "data" / "demo.parquet"),
                            out_dir="/tmp/draft_host_time", batches=(args.batch,), tasks=(args.task,),
                            temperatures=(0.0,), prompt_lengths=("short",), gammas=(0,), gamma_max=5, auto=True,
                            transformers=False, prompt_lookup_tokens=0, max_new_tokens=64, reps=1, threads=1,
                            drafts=("auto", "ngram"), layouts=(), min_rows=8, index_rows=args.index_rows)
    sut = runner.load_systems(spec)
    cells = runner.make_cells(spec, sut.engine)
    sut.indexes = runner.task_indexes(spec, sut, cells)
    priors = runner.warm_up(spec, sut, cells)
    cell = cells[0]
    sut.engine.max_batch_size = cell.batch
    total, calls = collections.defaultdict(float), collections.Counter()

    def timed(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)

        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[label] += time.perf_counter() - t0
                calls[label] += 1
        setattr(owner, name, call)

    timed(drafting.DraftPlanner, "plan", "plan (all of it)")
    timed(ngram.NgramSource, "propose", "n-gram lookup")
    timed(drafting.DraftPlanner, "_lengths", "draft lengths")
    timed(drafting.DraftPlanner, "_lookup_may_pay", "lookup pre-check")
    name = f"draft={args.draft}"
    runner.measure(spec, sut, cell, name, priors[cell.key()])       # untimed: the first call's fits
    total.clear()
    calls.clear()
    steps = 0
    for _ in range(args.calls):
        runner.measure(spec, sut, cell, name, priors[cell.key()])
        steps += len(sut.auto.last_stats.steps)        # draft=... systems run on the auto engine
    print(f"{args.task}, batch {args.batch}, {name}: {steps} steps over {args.calls} calls")
    for label in sorted(total, key=lambda k: -total[k]):
        print(f"  {label:18s} {total[label] / steps * 1e6:7.1f} us per step, {total[label] / calls[label] * 1e6:7.1f} us "
              f"per call ({calls[label]} calls)")


if __name__ == "__main__":
    main()
