"""What a verify step costs when its rows hold different contexts: all rows at a short
context, all at a long one, and all short but one long (real clock, fastest of --reps
interleaved repetitions).

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

    from pipeline.bench.step_costs import median_times
    from pipeline.engine import Engine
    from pipeline.model.cache import Batch, KVCache

    torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, device="auto", max_batch_size=args.rows)
    cfg, dev = engine.config, engine.device
    cache = KVCache(cfg.num_layers, args.rows, max(args.long) + max(args.tokens) + 1, cfg.num_kv_heads,
                    cfg.head_dim, engine.dtype, dev)

    def verify(starts: torch.Tensor, q: int):
        tokens = torch.randint(0, cfg.vocab_size, (args.rows, q), device=dev)
        batch = Batch.make((starts[:, None] + torch.arange(q)).to(dev))
        return lambda: engine.target(tokens, batch, cache)

    print(f"{args.rows} rows, ms per verify forward (fastest of {args.reps}), device {dev}\n")
    print("| tokens | long | all short | all long | short but one long | mean context of the last |")
    print("|---:|---:|---:|---:|---:|---:|")
    for q in args.tokens:
        layouts = {"short": torch.full((args.rows,), args.short)}
        for long in args.long:
            layouts[("long", long)] = torch.full((args.rows,), long)
            layouts[("mixed", long)] = torch.full((args.rows,), args.short)
            layouts[("mixed", long)][0] = long
        ms = {k: 1e3 * s for k, s in median_times({k: verify(v, q) for k, v in layouts.items()}, args.reps, dev,
                                                   stat=min).items()}
        for long in args.long:
            mean = float(layouts[("mixed", long)].float().mean())
            print(f"| {q} | {long} | {ms['short']:.1f} | {ms[('long', long)]:.1f} | {ms[('mixed', long)]:.1f} | "
                  f"{mean:.0f} |")


if __name__ == "__main__":
    main()
