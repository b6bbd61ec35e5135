"""The MTP heads' prompt window (pipeline.model.draft_window): tokens per step and the heads'
fill time at each window, per task, with the data's prompts and with long ones.

    python benchmarks/draft_window.py                                  # demo model and dataset
    python benchmarks/draft_window.py --windows 0 32 64 128 --write    # also store the choice
    python benchmarks/draft_window.py --model CKPT --data prompts.parquet --column prompt --write

Prompts: the demo tasks' rows in their formats, or (`--column`) any Parquet column as it is.
Greedy decoding at a fixed gamma (`--gamma`), `--prompts` prompts of each task decoded `--batch`
at a time, once with the data's prompts and once with each prompt after other rows' texts up to
`--long` tokens (the bench's long prompts). Tokens per step are counts (greedy: the same on any
machine); fill ms is the heads' prompt fill a prompt, and tokens/s the decode rate with those
fills counted (the target's prefill left out, as `+job=bench` does), both on this machine. Every
window's text is checked against the whole prompt's. `--write` stores the window that
`choose_window` picks as the checkpoint's `draft_window.json`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

import torch  # noqa: E402

from pipeline.bench.draft_window import markdown, measure_windows, tokens_per_step  # noqa: E402
from pipeline.demo.tasks import TEMPLATES  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline.model.draft_window import choose_window, write_draft_window  # noqa: E402

DEMO = ROOT / "pipeline" / "assets" / "demo"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEMO / "model")
    ap.add_argument("--data", type=Path, default=DEMO / "data" / "demo.parquet")
    ap.add_argument("--tasks", nargs="+", default=list(TEMPLATES), help="demo tasks of --data")
    ap.add_argument("--column", default=None, help="any Parquet: this column's values as the prompts (no tasks)")
    ap.add_argument("--windows", type=int, nargs="+", default=[0, 32, 64, 128, 256], help="0: the whole prompt")
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=24, help="prompts per task and length")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--long", type=int, default=384, help="a long prompt's tokens at least (0: data prompts only)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--write", action="store_true", help="store the chosen window with the checkpoint")
    ap.add_argument("--out", type=Path, default=None, help="also write the cells as JSON here")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, device=args.device, max_batch_size=args.batch)
    cells = measure_windows(engine, args.data, args.tasks, args.windows, args.gamma, args.prompts, args.batch,
                            args.long, args.new, args.column)
    measured = tokens_per_step(cells, args.windows)
    chosen = choose_window(measured)
    print(f"{args.model}, gamma {args.gamma}, batch {args.batch}, {args.prompts} prompts a cell, "
          f"{torch.get_num_threads()} threads\n")
    print(markdown(cells, args.windows))
    print(f"chosen window: {chosen or 'all'} (pipeline.model.draft_window.choose_window)")
    if args.write:
        src = (f"benchmarks/draft_window.py --windows {' '.join(map(str, sorted(measured)))} --gamma {args.gamma} "
               f"--prompts {args.prompts} --long {args.long} on {args.data.name}"
               + (f" column {args.column}" if args.column else ""))
        print("wrote", write_draft_window(args.model, chosen, measured, src))
    report = {"chosen": chosen, "cells": {c: {str(w): v for w, v in by_w.items()} for c, by_w in cells.items()}}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
