"""Draft sources side by side: gamma 0, the heads alone (auto), n-grams alone (draft=ngram) and
per-row sources (draft=auto), the last with each verify layout (padded, packed) as well.

    python benchmarks/draft_sources.py --threads 1                       # demo model and dataset
    python benchmarks/draft_sources.py --batches 1 48 --tasks json --reps 3

The `+job=bench` matrix (pipeline/bench/runner.py) on the demo tasks, greedy, short prompts.
Each task's n-gram index starts every timed call from the outputs of --index-rows rows of the
task that no cell uses (as earlier shards leave it on an actor). A batch-1 cell decodes
--min-rows prompts in turn. Writes bench.md (targets, tables, per-source draft counts),
bench.json and bench_plots.html to --out and prints bench.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

from pipeline.bench.virtual_clock import add_clock_args, clock_from_args  # noqa: E402
from pipeline.bench.report import write_all  # noqa: E402
from pipeline.bench.runner import BenchSpec, machine_info, run_matrix  # noqa: E402

DEMO = ROOT / "pipeline" / "assets" / "demo"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEMO / "model")
    ap.add_argument("--data", type=Path, default=DEMO / "data" / "demo.parquet")
    ap.add_argument("--tasks", nargs="+", default=["summarize", "complete", "json"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 48])
    ap.add_argument("--new", type=int, default=64, help="max new tokens per row")
    ap.add_argument("--min-rows", type=int, default=8, help="prompts per cell at least")
    ap.add_argument("--index-rows", type=int, default=480)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/draft_sources"), help="output folder")
    add_clock_args(ap)
    return ap.parse_args(argv)


def spec_from(args: argparse.Namespace) -> BenchSpec:
    return BenchSpec(model_path=str(args.model), data_path=str(args.data), out_dir=str(args.out),
                     batches=tuple(args.batches), tasks=tuple(args.tasks), temperatures=(0.0,),
                     prompt_lengths=("short",), gammas=(0,), gamma_max=5, auto=True, transformers=False, prompt_lookup_tokens=0,
                     max_new_tokens=args.new, reps=args.reps, threads=args.threads, drafts=("auto", "ngram"),
                     layouts=("padded", "packed"), min_rows=args.min_rows, index_rows=args.index_rows)


def main(argv=None) -> None:
    args = parse_args(argv)
    spec = spec_from(args)
    with clock_from_args(args):
        result = run_matrix(spec, log=lambda *_: None)
    print(f"model: {args.model}\n")
    print(write_all(result, args.out, machine_info(spec, result)))


if __name__ == "__main__":
    main()
