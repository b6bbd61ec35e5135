"""What one actor does with one shard, without Ray: read, prompt, generate per task, assemble.

`process_shard(engine, task)` is plain Python over any object with the Engine API, so it is
tested directly. Rows are grouped by task (`data.task_column`) and each group is one
`engine.generate` call, so acceptance is measured per task. A row whose prompt cannot be built
gets an output row with `error` set and is not sent to the engine.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import pyarrow as pa

from pipeline.config import DataConfig, SamplingConfig
from pipeline.data.outputs import error_results, output_table
from pipeline.data.plan import Shard
from pipeline.data.prompts import build_prompts, needed_columns, row_ids, row_tasks
from pipeline.data.read import read_shard
from pipeline.dist.utilization import UtilizationMeter


@dataclass(frozen=True)
class ShardTask:
    shard: Shard
    attempt: int                      # 1 for the first try
    files: tuple[str, ...]
    file_rows: tuple[int, ...]
    data: DataConfig
    keep_columns: tuple[str, ...]
    sampling: SamplingConfig
    gamma: int | str                  # spec.gamma: 'auto' or an int >= 0


@dataclass
class ShardResult:
    table: pa.Table                   # the shard's output rows, in input order
    stats_rows: list[dict] = field(default_factory=list)   # one per task in the shard


def shard_seed(seed: int, shard: Shard, group: int) -> int:
    """A seed per (shard, task group) from sampling.seed and the shard's stable position, so
    shards do not share random streams and a rerun of a shard draws the same ones."""
    return (seed * 1_000_003 + shard.start * 31 + group) % (2**31 - 1)


def group_by_task(tasks: Sequence[str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, task in enumerate(tasks):
        groups.setdefault(task, []).append(i)
    return groups


def output_result(out: Any) -> dict:
    """An engine output as the output table's per-row fields."""
    return {
        "generated_text": out.text, "finish_reason": out.finish_reason, "error": out.error,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_generated_tokens": len(out.token_ids),
        "num_drafted_tokens": out.num_drafted_tokens,
        "num_accepted_tokens": out.num_accepted_tokens,
    }


def gamma_in_use(engine_stats: Any, gamma: int | str) -> tuple[int | None, str]:
    """(gamma, reason) for the stats row. A fixed gamma is the config's; for 'auto' the most
    used gamma of the engine's recorded steps, when the steps say which."""
    if gamma != "auto":
        return int(gamma), f"fixed by config (spec.gamma={gamma})"
    used = Counter(getattr(s, "gamma", None) for s in getattr(engine_stats, "steps", []) or [])
    used.pop(None, None)
    if used:
        return used.most_common(1)[0][0], "auto: chosen inside the engine (driver policy pending)"
    return None, "auto: chosen inside the engine; gamma not reported"


def _finite(x: float) -> float | None:
    """NaN (nothing measured, e.g. no verify step) is stored as null."""
    x = float(x)
    return None if x != x else x


def generate_group(engine: Any, prompts: list[str], sampling: SamplingConfig, seed: int,
                   gamma: int | str, info: dict) -> tuple[list[dict], dict]:
    """One generate call; per-row results and the measured part of the stats row."""
    from pipeline.engine import SamplingParams

    params = SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                            top_p=sampling.top_p, top_k=sampling.top_k, seed=seed,
                            stop=tuple(sampling.stop))
    engine.reset_stats()
    wall0 = time.perf_counter()
    with UtilizationMeter(info.get("device", "cpu"), int(info.get("threads", 1))) as meter:
        outs = engine.generate(prompts, params, gamma=gamma)
    wall = time.perf_counter() - wall0
    results = [output_result(o) for o in outs]
    stats = engine.stats
    generated = sum(r["num_generated_tokens"] for r in results)
    chosen, reason = gamma_in_use(stats, gamma)
    measured = {
        "gamma": chosen, "gamma_reason": reason,
        "gamma_candidates": [], "predicted_goodput": [],     # filled by the gamma policy
        "acceptance_by_depth": [_finite(a) for a in stats.acceptance_by_depth()],
        "mean_acceptance_length": _finite(stats.mean_acceptance_length()),
        "tokens_per_s": generated / wall if wall > 0 else None,
        "draft_time_s": float(stats.draft_time_s), "verify_time_s": float(stats.verify_time_s),
        "utilization": meter.value, "num_generated_tokens": generated,
    }
    return results, measured


def process_shard(engine: Any, task: ShardTask, info: dict | None = None) -> ShardResult:
    """Generate every row of `task.shard`; info carries device, actor_id, node_id, threads."""
    info = info or {}
    columns = needed_columns(task.data, task.keep_columns)
    table = read_shard(task.files, task.file_rows, task.shard, columns,
                       task.data.task_column, task.data.tasks)
    prompts, errors = build_prompts(table, task.data)
    results: list[dict | None] = [None] * table.num_rows
    stats_rows = []
    for g, (name, rows) in enumerate(group_by_task(row_tasks(table, task.data)).items()):
        for i in rows:
            if errors[i] is not None:
                results[i] = error_results(1, errors[i])[0]
        good = [i for i in rows if errors[i] is None]
        group_start = time.perf_counter()
        measured: dict = {"gamma_reason": "no rows to generate", "num_generated_tokens": 0}
        if good:
            outs, measured = generate_group(engine, [prompts[i] for i in good], task.sampling,
                                            shard_seed(task.sampling.seed, task.shard, g),
                                            task.gamma, info)
            for i, r in zip(good, outs):
                results[i] = r
        stats_rows.append(measured | {
            "shard_id": task.shard.shard_id, "task": name, "num_rows": len(rows),
            "num_errors": sum(1 for i in rows if results[i]["error"] is not None),
            "wall_time_s": time.perf_counter() - group_start, "attempt": task.attempt,
            "device": info.get("device"), "actor_id": info.get("actor_id"),
            "node_id": info.get("node_id"),
        })
    keep = table.select(list(task.keep_columns)) if task.keep_columns else None
    out = output_table(row_ids(table, task.data), prompts, results, keep)
    return ShardResult(out, stats_rows)


def failed_shard_result(task: ShardTask, message: str) -> ShardResult:
    """Output rows for a shard that failed every attempt: each row carries the error."""
    columns = needed_columns(task.data, task.keep_columns)
    table = read_shard(task.files, task.file_rows, task.shard, columns,
                       task.data.task_column, task.data.tasks)
    prompts, _ = build_prompts(table, task.data)
    keep = table.select(list(task.keep_columns)) if task.keep_columns else None
    out = output_table(row_ids(table, task.data), prompts,
                       error_results(table.num_rows, message), keep)
    stats_rows = [{"shard_id": task.shard.shard_id, "task": name, "num_rows": len(rows),
                   "num_errors": len(rows), "num_generated_tokens": 0, "attempt": task.attempt,
                   "gamma_reason": f"failed: {message}"[:500]}
                  for name, rows in group_by_task(row_tasks(table, task.data)).items()]
    return ShardResult(out, stats_rows)
