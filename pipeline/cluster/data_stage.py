"""The Ray Data stage behind `pipeline.ray_data.build_processor`: one engine per actor.

`GenerateStage` is the callable class `Dataset.map_batches` runs on its actor pool. Each actor
loads its engine once (the cluster actor's `ShardWorker` loading: model path checks and
fetching, loader, torch threads) and keeps, across batches, what the pipeline's actor keeps
across shards: its acceptance evidence per task (the prior of the gamma policy), the engine's
cost profile and KV caches. A batch is handled as the pipeline handles a shard
(`generate_table`): prompts built by pipeline.data.prompts, rows grouped by task, one
`generate_group` call per task, bad rows given `error`.

An engine call that raises is narrowed (`narrowed`): its rows are tried again in halves, down
to single rows, so good rows complete and each failing row gets `error`. An actor that dies
(OOM kill, lost node) is Ray Data's to restart and retry (`max_restarts`, `max_task_retries`).
"""
from __future__ import annotations

import inspect
import sys
import time
import uuid
from typing import Any, Callable, Sequence

import pyarrow as pa

from pipeline.config import OUTPUT_COLUMNS, DataConfig, EngineConfig, ModelConfig, UserError
from pipeline.engine.params import SamplingParams
from pipeline.cluster.stage_stats import StageStats
from pipeline.data.outputs import error_results, output_table
from pipeline.data.prompts import build_prompts, check_columns, row_tasks

ADDED_COLUMNS = OUTPUT_COLUMNS[2:]      # generated_text ... error: appended to the input's columns


def narrowed(call: Callable[[list[int]], list[dict]], rows: list[int]) -> list[dict]:
    """`call(rows)` -> one result per row (one engine call). When it raises, the rows are tried
    again in halves, down to single rows; a single row that still fails gets the error.
    Example: rows [0..3] where row 2 breaks the engine: [0..3] fails, [0, 1] passes, [2, 3]
    fails, [2] fails (error row), [3] passes: 5 calls, 3 good rows. A UserError (a problem
    with the input or the configuration, the same for every row) is not narrowed."""
    try:
        return call(rows)
    except UserError:
        raise
    except Exception as exc:
        if len(rows) == 1:
            return error_results(1, f"generation failed: {type(exc).__name__}: {exc}")
        mid = len(rows) // 2
        return narrowed(call, rows[:mid]) + narrowed(call, rows[mid:])


class DraftView:
    """The engine, with `draft=` passed to every generate call (when the engine takes it)."""

    def __init__(self, engine: Any, draft: str) -> None:
        self._engine, self._draft = engine, draft

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("draft", self._draft)
        return self._engine.generate(*args, **kwargs)


def with_draft(engine: Any, draft: str) -> Any:
    """`engine`, passing `draft` on where its generate has a `draft` parameter. An engine
    without draft sources (only MTP heads) ignores it: a value other than 'auto' is warned."""
    if "draft" in inspect.signature(engine.generate).parameters:
        return DraftView(engine, draft)
    if draft != "auto":
        print(f"warning: draft={draft!r} ignored: this engine's generate takes no draft "
              "argument (it drafts with its MTP heads)", file=sys.stderr)
    return engine


def generate_table(engine: Any, table: pa.Table, data: DataConfig, sampling: SamplingParams,
                   gamma: int | str, info: dict, priors: dict, stats: StageStats | None = None,
                   keys: Sequence[int] | None = None) -> tuple[list[dict], list[dict]]:
    """(one result per row of `table`, one stats row per task), as process_shard does for a
    shard. `priors` (task -> acceptance counters) carries the policy's evidence across calls;
    `keys`: each row's random-stream key; None keys each row by its prompt's text
    (pipeline.cluster.worker.row_key), the same in any batch or retry."""
    from pipeline.cluster.worker import generate_group, group_by_task, row_key

    prompts, errors = build_prompts(table, data)
    keys = list(keys) if keys is not None else [row_key(p) for p in prompts]
    results: list[dict | None] = [None] * table.num_rows
    stats_rows = []
    for task, rows in group_by_task(row_tasks(table, data)).items():
        for i in rows:
            if errors[i] is not None:
                results[i] = error_results(1, errors[i])[0]
        measured: dict = {}

        def call(idx: list[int]) -> list[dict]:
            nonlocal measured
            t0 = time.perf_counter()
            outs, measured, counts = generate_group(
                engine, [prompts[i] for i in idx], [keys[i] for i in idx],
                sampling, gamma, info, priors.get(task))
            if stats is not None:
                stats.observe_call(engine.last_stats, time.perf_counter() - t0)
            if counts is not None:
                priors[task] = counts if task not in priors else priors[task].merge(counts)
            return outs

        good = [i for i in rows if errors[i] is None]
        for i, r in zip(good, narrowed(call, good) if good else []):
            results[i] = r
        stats_rows.append({**measured, "task": task, "num_rows": len(rows),
                           "num_errors": sum(1 for i in rows if results[i]["error"] is not None),
                           "num_generated_tokens": sum(results[i].get("num_generated_tokens") or 0
                                                       for i in rows)})
    return results, stats_rows


def append_outputs(table: pa.Table, results: list[dict]) -> pa.Table:
    """The input table with ADDED_COLUMNS appended (types as in the pipeline's output files)."""
    ids = pa.array(range(table.num_rows), type=pa.int64())
    out = output_table(ids, [None] * table.num_rows, results)
    for name in ADDED_COLUMNS:
        table = table.append_column(out.schema.field(name), out[name])
    return table


class GenerateStage:
    """One actor of the processor's pool: `__call__(batch)` maps a pyarrow batch to the batch
    with ADDED_COLUMNS, one output row per input row. After each batch it reports its
    cumulative StageStats to `collector` and exports the batch through ray.util.metrics
    (pipeline.cluster.metrics names, tagged run=`run_name`; a batch counts as a shard there)."""

    def __init__(self, model: ModelConfig, engine: EngineConfig, data: DataConfig,
                 sampling: SamplingParams, gamma: int | str, gamma_max: int, draft: str,
                 num_threads: int | None, loader: Any, collector: Any, run_name: str,
                 draft_window: int | None = None) -> None:
        from pipeline.cluster.actor import ShardWorker
        from pipeline.cluster.metrics import RunMetrics
        from pipeline.cluster.worker import apply_spec

        worker = ShardWorker(model, engine, num_threads, loader)
        apply_spec(worker.engine, gamma_max, draft_window)
        self.engine = with_draft(worker.engine, draft)
        self.info, self.priors = worker.info, worker.priors
        self.data, self.sampling, self.gamma = data, sampling, gamma
        self.collector, self.stats = collector, StageStats()
        self.key = f"{self.info['actor_id']}-{uuid.uuid4().hex[:8]}"   # a restarted actor is new
        self.metrics = RunMetrics(run_name)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from pipeline.cluster.worker import row_key

        check_columns(batch.schema, self.data, ())
        clash = [c for c in ADDED_COLUMNS if c in batch.column_names]
        if clash:
            raise UserError(f"the dataset already has output column(s) {clash}; rename or drop them")
        keys = None       # as in a run with data.id_column, else by the prompt's text
        if self.data.id_column:
            keys = [row_key(v) for v in batch[self.data.id_column].to_pylist()]
        results, stats_rows = generate_table(self.engine, batch, self.data, self.sampling,
                                             self.gamma, self.info, self.priors, self.stats, keys)
        self.stats.observe_rows(results)
        self.metrics.observe(stats_rows)
        self._report()
        return append_outputs(batch, results)

    def _report(self) -> None:
        """Send the cumulative stats to the collector; a failure never fails the batch."""
        if self.collector is None:
            return
        try:
            import ray

            snapshot = {k: self.info.get(k) for k in ("actor_id", "node_id", "device")}
            ray.get(self.collector.report.remote(self.key, snapshot, self.stats), timeout=60)
        except Exception as exc:
            print(f"warning: stage stats not reported: {exc}", file=sys.stderr)
