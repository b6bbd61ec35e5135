"""The driver's cost per shard commit, and its memory, as the number of committed shards grows.

    python benchmarks/commit_scale.py --shards 4000 --at 500 4000

Drives the commit path directly (no Ray, no model): a dataset of --shards one-row shards is
planned with `open_run`, and for each shard the part is written as an actor writes it
(`commit_part`, not timed), then the driver's side is timed: `RunRecord.mark_committed` (checks
the part, writes the shard's stats file and the manifest) and `RunRecord.totals()` (the
progress bar's and metrics' totals), as `pipeline.cluster.driver._commit` does. Each stats row
carries what a real shard's does: 64 cost samples of 5 numbers, acceptance by depth, and so on.

Reports, at each --at count, the median driver time of the --window commits before it, and the
Python heap the driver holds then (tracemalloc, on throughout, so times include its overhead;
ratios within the run are what to read), plus the run's peak heap and max RSS.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import RunConfig
from pipeline.data.commit import commit_part
from pipeline.data.outputs import error_results, output_table
from pipeline.data.record import open_run


def stats_row(shard_id: int) -> dict:
    """One task's stats row, the size of a real one (64 x 5 cost samples)."""
    return {"shard_id": shard_id, "task": "default", "num_rows": 1, "gamma": 3,
            "gamma_reason": "auto: best predicted goodput", "gamma_candidates": [0, 1, 2, 3, 4, 5],
            "predicted_goodput": [10.0, 14.0, 17.0, 19.0, 18.0, 16.0],
            "acceptance_by_depth": [0.8, 0.6, 0.5, 0.4, 0.3], "mean_acceptance_length": 2.5,
            "tokens_per_s": 100.0, "draft_time_s": 0.01, "verify_time_s": 0.02,
            "wall_time_s": 0.03, "utilization": 0.9, "device": "cpu", "actor_id": "a" * 32,
            "node_id": "n" * 56, "attempt": 1, "num_generated_tokens": 1, "num_errors": 0,
            "started_at": 1.0, "finished_at": 2.0, "predicted_goodput_gamma0": 10.0,
            "cost_samples": [[4.0, 4.0, 100.0 + i, 0.02, 0.01] for i in range(64)],
            "cost_model_verify": [0.01, 0.001, 0.0, 0.0, 64.0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=4000)
    ap.add_argument("--at", type=int, nargs="+", default=[500, 4000])
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--out", default=None, help="JSON results file")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="commit_scale-"))
    data = root / "d.parquet"
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in range(args.shards)]}), data)
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    raw = {"model": {"path": str(model)}, "data": {"path": str(data)},
           "output": {"dir": str(root / "run")}, "shards": {"rows_per_shard": 1},
           "spec": {"gamma": 0}}
    record = open_run(RunConfig.from_dict(raw), raw)
    table = output_table(pa.array([0]), ["p"], error_results(1, "x"))
    times, held = [], {}
    tracemalloc.start()
    for shard in record.plan:
        rows = [stats_row(shard.shard_id)]
        commit_part(record.store, shard.shard_id, table, rows)        # the actor's write
        t0 = time.perf_counter()
        record.mark_committed(shard, 1, rows)
        record.totals()
        times.append(time.perf_counter() - t0)
        n = len(times)
        if n in args.at:
            held[n] = tracemalloc.get_traced_memory()[0]
            print(f"{n} committed: {1e3 * statistics.median(times[-args.window:]):.2f} ms per commit, "
                  f"heap held {held[n] / 1e6:.2f} MB", flush=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    record.save("finished")
    result = {"shards": args.shards, "machine": platform.machine(), "python": platform.python_version(),
              "peak_heap_mb": peak / 1e6, "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
              "at": {n: {"median_commit_ms": 1e3 * statistics.median(times[max(0, n - args.window):n]),
                         "heap_held_mb": held[n] / 1e6} for n in args.at if n in held}}
    print("| committed shards | driver ms per commit (median of the last %d) | heap held (MB) |" % args.window)
    print("|---:|---:|---:|")
    for n, r in result["at"].items():
        print(f"| {n} | {r['median_commit_ms']:.2f} | {r['heap_held_mb']:.2f} |")
    print(f"peak heap {result['peak_heap_mb']:.1f} MB, max RSS {result['max_rss_mb']:.0f} MB, "
          f"total {sum(times):.1f} s in commits")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
