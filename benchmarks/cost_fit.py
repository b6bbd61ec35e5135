"""How well the cost model fits the engine's start-up profile: each profiled verify forward
against the fitted model's price, and the relative error over all of them.

    python benchmarks/cost_fit.py --rows 48 --threads 1 [--clock virtual --prices P]

A shape the model misprices misleads the gamma policy until speculation runs there (the local
correction borrows gamma 0's factor for an unmeasured gamma): stop 35 found one-token steps at 48
rows priced 26% low, four-token steps right (docs/decisions.md, 2026-12-03).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

from pipeline.bench.virtual_clock import add_clock_args, clock_from_args  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "pipeline" / "assets" / "demo" / "model"))
    ap.add_argument("--rows", type=int, default=48, help="the largest batch profiled")
    ap.add_argument("--threads", type=int, default=1)
    add_clock_args(ap)
    args = ap.parse_args(argv)
    import torch

    from pipeline.engine import Engine
    from pipeline.spec_decode.cost import fit_cost_model

    torch.set_num_threads(args.threads)
    with clock_from_args(args):
        engine = Engine.from_pretrained(args.model, max_batch_size=args.rows)
        engine.ensure_profile(rows=args.rows)
    profile = [s for s in engine.costs.profile if s.verify_s > 0]
    model = fit_cost_model([], profile)
    print(f"verify a b h c {model.verify_coef}, knee {model.knee:g}, m {model.multi_token_s:.3g}, "
          f"per row r s {model.row_coef}")
    print("| rows | context | q: modelled / measured ms |")
    print("|---:|---:|---|")
    for rows, ctx in sorted({(s.rows, s.context_len) for s in profile}):
        cells = [f"q{s.query_len} {1e3 * model.verify_s(s.rows, s.query_len, ctx):.1f} / {1e3 * s.verify_s:.1f}"
                 for s in sorted(profile, key=lambda s: s.query_len) if (s.rows, s.context_len) == (rows, ctx)]
        print(f"| {rows} | {ctx:.0f} | {', '.join(cells)} |")
    err = [abs(model.verify_s(s.rows, s.query_len, s.context_len) / s.verify_s - 1) for s in profile]
    print(f"relative error over {len(err)} forwards: median {statistics.median(err):.1%}, largest {max(err):.1%}")


if __name__ == "__main__":
    main()
