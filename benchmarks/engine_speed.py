"""Engine tokens/s at gamma 0..G against transformers generate(), same checkpoint and prompts.

    python benchmarks/engine_speed.py                       # the demo model if built, else a synthetic one
    python benchmarks/engine_speed.py --model PATH --batches 1 8 32 --gammas 0 1 2 3 4 5

The `+job=bench` matrix (pipeline/bench/runner.py) narrowed to one cell per batch size: random
token-id prompts (no dataset or tokenizer needed), greedy, EOS ignored so every row generates
exactly --new tokens, no auto and no prompt lookup. Decode tokens/s, prefill apart; medians of
--reps interleaved repetitions, ratios within this one run. Writes bench.md, bench.json and
bench_plots.html to --out and prints bench.md.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

from pipeline.bench.prompts import RANDOM  # noqa: E402
from pipeline.bench.report import write_all  # noqa: E402
from pipeline.bench.runner import BenchSpec, machine_info, run_matrix  # noqa: E402
from pipeline.model.tiny import make_tiny_checkpoint  # noqa: E402

DEMO = ROOT / "pipeline" / "assets" / "demo" / "model"


def synthetic_checkpoint(root: Path) -> Path:
    """A demo-sized Llama (about 5M parameters) whose heads draft well by construction."""
    return make_tiny_checkpoint(root / "synthetic", arch="llama", num_mtp_layers=1, vocab_size=4096,
                                hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                                intermediate_size=768, max_position_embeddings=1024,
                                initializer_range=0.05, draftable=0.1, with_tokenizer=False)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--gammas", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    ap.add_argument("--new", type=int, default=64, help="tokens generated per row")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_speed"), help="output folder")
    return ap.parse_args(argv)


def spec_from(args: argparse.Namespace, model: Path) -> BenchSpec:
    return BenchSpec(model_path=str(model), data_path=None, out_dir=str(args.out), batches=tuple(args.batches),
                     tasks=(RANDOM,), temperatures=(0.0,), prompt_lengths=("short",),
                     random_prompt_tokens=args.prompt_len, gammas=tuple(args.gammas), auto=False,
                     prompt_lookup_tokens=0, max_new_tokens=args.new, ignore_eos=True, reps=args.reps,
                     device=args.device, threads=args.threads)


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or (DEMO if (DEMO / "config.json").exists() else synthetic_checkpoint(Path(tmp)))
        spec = spec_from(args, model)
        result = run_matrix(spec, log=lambda *_: None)
        print(f"model: {model}\n")
        print(write_all(result, args.out, machine_info(spec, result)))


if __name__ == "__main__":
    main()
