"""gamma=auto against every fixed gamma, per demo task, at a small and a large batch.

    python benchmarks/gamma_policy.py                          # demo model and dataset
    python benchmarks/gamma_policy.py --batches 1 48 --reps 7 --new 64 --threads 1

What it measures and how: pipeline/bench/gamma_policy.py. Prints a Markdown table and writes
JSON to --out; results with their command, commit and machine go to benchmarks/RESULTS.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

from pipeline.bench.virtual_clock import add_clock_args, clock_from_args  # noqa: E402
from pipeline.bench.gamma_policy import GammaPolicySpec, markdown_table, run_gamma_policy  # noqa: E402
from pipeline.demo.tasks import TEMPLATES  # noqa: E402

DEMO_MODEL = ROOT / "pipeline" / "assets" / "demo" / "model"
DEMO_DATA = ROOT / "pipeline" / "assets" / "demo" / "data" / "demo.parquet"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEMO_MODEL)
    ap.add_argument("--data", type=Path, default=DEMO_DATA)
    ap.add_argument("--tasks", nargs="+", default=list(TEMPLATES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 48])
    ap.add_argument("--gamma-max", type=int, default=5)
    ap.add_argument("--new", type=int, default=64, help="tokens generated per row at most")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--min-prompts", type=int, default=24)
    ap.add_argument("--max-warmups", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gamma_policy.json"))
    add_clock_args(ap)
    return ap.parse_args(argv)


def spec_from(args: argparse.Namespace) -> GammaPolicySpec:
    return GammaPolicySpec(model_path=str(args.model), data_path=str(args.data), tasks=tuple(args.tasks),
                           batches=tuple(args.batches), gamma_max=args.gamma_max, max_new_tokens=args.new,
                           reps=args.reps, min_prompts=args.min_prompts, max_warmups=args.max_warmups,
                           threads=args.threads, device=args.device)


def main(argv=None) -> None:
    args = parse_args(argv)
    with clock_from_args(args):
        report = run_gamma_policy(spec_from(args))
    m = report["machine"]
    print(f"model {args.model} on {m['device']} ({m['torch_threads']} threads)\n")
    print(markdown_table(report))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
