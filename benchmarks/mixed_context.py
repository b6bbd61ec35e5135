"""What a verify step costs when its rows hold different contexts: all rows at a short
context, all at a long one, and all short but one long (real clock, fastest of --reps).

    python benchmarks/mixed_context.py --rows 48 --threads 1

Every row attends over the longest row's cache (pipeline.model.cache.Batch: kv_len is the
largest position), so one long row makes the step cost what a batch of long rows does; the cost
model therefore prices a step at its longest row's context (StepRecord.context_len), not the
mean. Example (stop 36, 2-core CPU, 1 thread, 1 token): 40.7 ms all at 40, 59.2 all at 200,
59.5 all at 40 but one at 200.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "pipeline" / "assets" / "demo" / "model"))
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--short", type=int, default=40, help="the short context")
    ap.add_argument("--long", type=int, nargs="+", default=[90, 200], help="long contexts")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 3], help="tokens verified per row")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch

    from pipeline.engine import Engine
    from pipeline.model.cache import Batch, KVCache

    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, device="auto", max_batch_size=args.rows)
    cfg, dev = engine.config, engine.device
    cache = KVCache(cfg.num_layers, args.rows, max(args.long) + max(args.tokens) + 1, cfg.num_kv_heads,
                    cfg.head_dim, engine.dtype, dev)

    def fastest(starts: torch.Tensor, q: int) -> float:
        tokens = torch.randint(0, cfg.vocab_size, (args.rows, q), device=dev)
        batch = Batch.make((starts[:, None] + torch.arange(q)).to(dev))
        best = float("inf")
        for _ in range(args.reps + 1):             # the first run warms up
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            engine.target(tokens, batch, cache)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - t0)
        return 1e3 * best

    print(f"{args.rows} rows, ms per verify forward (fastest of {args.reps}), device {dev}\n")
    print("| tokens | long | all short | all long | short but one long | mean context of the last |")
    print("|---:|---:|---:|---:|---:|---:|")
    for q in args.tokens:
        short = fastest(torch.full((args.rows,), args.short), q)
        for long in args.long:
            mixed = torch.full((args.rows,), args.short)
            mixed[0] = long
            print(f"| {q} | {long} | {short:.1f} | {fastest(torch.full((args.rows,), long), q):.1f} | "
                  f"{fastest(mixed, q):.1f} | {float(mixed.float().mean()):.0f} |")


if __name__ == "__main__":
    main()
