"""verify(q)/verify(1) and draft-depth/step ratios of a checkpoint (pipeline/bench/step_costs.py).

    python benchmarks/step_costs.py                                  # the demo model, batch 1 and 48
    python benchmarks/step_costs.py --model PATH --rows 1 48 --ctx 64 256 --threads 1
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

import torch  # noqa: E402

from pipeline.bench.step_costs import measure, table  # noqa: E402
from pipeline.engine import Engine  # noqa: E402

DEMO = ROOT / "pipeline" / "assets" / "demo" / "model"


def set_draft_vocab(engine, choice: str) -> None:
    """auto: the checkpoint's own; off: the full vocabulary; N: the first N ids (cost only: what a
    depth costs does not depend on which N tokens it drafts over)."""
    if choice == "auto":
        return
    ids = None if choice == "off" else torch.arange(int(choice), device=engine.device)
    for head in engine.heads:
        head.set_draft_vocab(ids)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEMO)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 48])
    ap.add_argument("--ctx", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--q-max", type=int, default=6)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--draft-vocab", default="auto", help="auto (the checkpoint's), off, or a size N")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, device=args.device)
    set_draft_vocab(engine, args.draft_vocab)
    results = [measure(engine, r, c, q_max=args.q_max, reps=args.reps) for r in args.rows for c in args.ctx]
    vd = engine.heads[0].draft_ids.numel() if engine.heads and engine.heads[0].draft_ids is not None else "full"
    print(f"model: {args.model}  threads: {torch.get_num_threads()}  device: {engine.device}  draft vocab: {vd}\n")
    print(table(results))


if __name__ == "__main__":
    main()
