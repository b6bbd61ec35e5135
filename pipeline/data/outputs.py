"""The output table of a shard (DESIGN.md's columns) and the per-shard stats table."""
from __future__ import annotations

from typing import Sequence

import pyarrow as pa

from pipeline.config import OUTPUT_COLUMNS

_COUNTS = ("num_prompt_tokens", "num_generated_tokens", "num_drafted_tokens",
           "num_accepted_tokens")

STATS_SCHEMA = pa.schema([
    ("shard_id", pa.int64()),
    ("task", pa.string()),
    ("num_rows", pa.int64()),
    ("planned_gamma", pa.int64()),                  # the driver's plan (null: nothing to plan from)
    ("gamma", pa.int64()),                          # gamma in use (null when not known)
    ("gamma_steps", pa.list_(pa.int64())),          # verify steps per gamma (index = gamma)
    ("calibration_steps", pa.int64()),              # steps run at gamma_max to measure acceptance
    ("prior_row_steps", pa.int64()),                # evidence (row-steps at depth 1) the policy started from
    ("gamma_reason", pa.string()),
    ("gamma_candidates", pa.list_(pa.int64())),     # aligned with predicted_goodput
    ("predicted_goodput", pa.list_(pa.float64())),
    ("acceptance_by_depth", pa.list_(pa.float64())),  # a_k, k = 1..
    ("mean_acceptance_length", pa.float64()),       # emitted tokens per verify step per row
    ("drafted_by_source", pa.map_(pa.string(), pa.int64())),   # draft tokens verified per source (mtp, ngram)
    ("accepted_by_source", pa.map_(pa.string(), pa.int64())),  # ... and accepted
    ("tokens_per_s", pa.float64()),                 # generated tokens / wall time
    ("draft_time_s", pa.float64()),
    ("verify_time_s", pa.float64()),
    ("wall_time_s", pa.float64()),
    ("utilization", pa.float64()),                  # accelerator or CPU share, 0..1
    ("device", pa.string()),
    ("actor_id", pa.string()),
    ("node_id", pa.string()),
    ("attempt", pa.int64()),
    ("num_generated_tokens", pa.int64()),           # beyond DESIGN.md: for pooled totals
    ("num_errors", pa.int64()),                     # rows whose error is set
    ("host_time_s", pa.float64()),                  # the steps' time outside draft and verify
    # beyond DESIGN.md, for the dashboard (pipeline/dashboard):
    ("started_at", pa.float64()),                   # unix seconds when the task group began
    ("finished_at", pa.float64()),                  # unix seconds when it ended
    ("predicted_goodput_gamma0", pa.float64()),     # cost model's tokens/s at gamma 0
    ("cost_samples", pa.list_(pa.list_(pa.float64()))),  # <= 64 x [rows, q, ctx, verify_s, draft_s]
    ("cost_model", pa.string()),                    # the cost model used: JSON of CostModel.to_dict()
    # beyond DESIGN.md, the run's evidence (pipeline.spec_decode.evidence):
    ("prior_source", pa.string()),                  # where the prior came from
    ("reached_by_depth", pa.list_(pa.int64())),     # row-steps that verified draft k (k = 1..)
    ("accepted_by_depth", pa.list_(pa.int64())),    # ... and accepted it
])


def output_table(ids: pa.Array, prompts: Sequence[str | None], results: Sequence[dict],
                 keep: pa.Table | None = None) -> pa.Table:
    """One row per input row. results[i] holds generated_text, finish_reason, error and the
    counts of OUTPUT_COLUMNS; keep holds the input columns of output.keep_columns."""
    assert len(ids) == len(prompts) == len(results)
    columns = {
        "id": ids,
        "prompt": pa.array(prompts, type=pa.string()),
        "generated_text": pa.array([r.get("generated_text") for r in results], type=pa.string()),
        "finish_reason": pa.array([r["finish_reason"] for r in results], type=pa.string()),
    }
    for name in _COUNTS:
        columns[name] = pa.array([int(r.get(name) or 0) for r in results], type=pa.int64())
    columns["error"] = pa.array([r.get("error") for r in results], type=pa.string())
    assert tuple(columns) == OUTPUT_COLUMNS
    table = pa.table(columns)
    if keep is not None:
        for name in keep.column_names:
            table = table.append_column(keep.schema.field(name), keep[name])
    return table


def error_results(n: int, message: str) -> list[dict]:
    """Results for rows that could not be generated: they still get an output row."""
    return [{"generated_text": None, "finish_reason": "error", "error": message}] * n


def stats_table(rows: Sequence[dict]) -> pa.Table:
    return pa.Table.from_pylist([{k: r.get(k) for k in STATS_SCHEMA.names} for r in rows],
                                schema=STATS_SCHEMA)
