"""The device check for a GPU machine: `+job=bench`'s matrix narrowed, without Hydra (a bare GPU
image holds torch and transformers but not hydra-core, Ray or plotly).

    bash benchmarks/gpu_check.sh                 # tests/gpu, then this, logs and tables to $OUT
    python benchmarks/gpu_check.py --out DIR --batches 1 8 32 64 --reps 3

The demo model and dataset, greedy, short prompts, every fixed gamma, auto and transformers
generate() at each batch size, on `--device` (default cuda) in the checkpoint's dtype for it
(`dtype=auto`: bfloat16 on CUDA). Writes bench.md and bench.json to --out (bench_plots.html too
where plotly is installed) and prints bench.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

from pipeline.bench.report import write_all  # noqa: E402
from pipeline.bench.runner import BenchSpec, machine_info, run_matrix  # noqa: E402
from pipeline.demo.build import ASSETS  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ASSETS / "model")
    ap.add_argument("--data", type=Path, default=ASSETS / "data" / "demo.parquet")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--tasks", nargs="+", default=["summarize", "complete", "json"])
    ap.add_argument("--new", type=int, default=64, help="max new tokens per row")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check"))
    return ap.parse_args(argv)


def spec_from(args: argparse.Namespace) -> BenchSpec:
    return BenchSpec(model_path=str(args.model), data_path=str(args.data), out_dir=str(args.out), device=args.device,
                     batches=tuple(args.batches), tasks=tuple(args.tasks), temperatures=(0.0,), prompt_lengths=("short",),
                     max_new_tokens=args.new, reps=args.reps, min_rows=8)


def main(argv=None) -> None:
    args = parse_args(argv)
    spec = spec_from(args)
    result = run_matrix(spec, log=print)
    print(write_all(result, args.out, machine_info(spec, result), plots=importlib.util.find_spec("plotly") is not None))


if __name__ == "__main__":
    main()
