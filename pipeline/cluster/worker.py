"""What one actor does with one shard, without Ray: read, prompt, generate per task, assemble.

`process_shard(engine, task)` is plain Python over any object with the Engine API, so it is
tested directly. Rows are grouped by task (`data.task_column`) and each group is one
`engine.generate` call, so acceptance is measured per task. A row whose prompt cannot be built
gets an output row with `error` set and is not sent to the engine.
"""
from __future__ import annotations

import hashlib
import inspect
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import pyarrow as pa

from pipeline.config import DataConfig, UserError
from pipeline.data.commit import commit_part
from pipeline.data.outputs import error_results, output_table
from pipeline.data.plan import Shard
from pipeline.data.prompts import build_prompts, needed_columns, row_ids, row_tasks
from pipeline.data.read import read_shard
from pipeline.engine.params import DEFAULT_GAMMA_MAX, SamplingParams
from pipeline.cluster.step_samples import (cost_model_json, cost_samples, predicted_gamma0_tokens_per_s,
                                           shard_cost_model)
from pipeline.cluster.plan_stats import actor_costs, plan_fields
from pipeline.cluster.utilization import UtilizationMeter
from pipeline.spec_decode.plan import ShardPlan, TaskPlan


@dataclass(frozen=True)
class ShardTask:
    shard: Shard
    attempt: int                      # 1 for the first try
    files: tuple[str, ...]
    file_rows: tuple[int, ...]
    data: DataConfig
    keep_columns: tuple[str, ...]
    sampling: SamplingParams
    gamma: int | str                  # spec.gamma: 'auto' or an int >= 0
    gamma_max: int = DEFAULT_GAMMA_MAX   # spec.gamma_max: caps 'auto'
    draft: str = "auto"               # spec.draft: 'auto', 'mtp', 'ngram' or 'none'
    draft_window: int | None = None   # spec.draft_window: prompt tokens the heads read (None: the checkpoint's)
    output_dir: str | None = None     # run directory (path or URI) the actor commits to; None: return rows
    probe: tuple[int, int] | None = None   # only rows [lo, hi) of the shard, output discarded (narrow.py)
    bad_rows: tuple[tuple[int, str], ...] = ()   # (row of the shard, error): written, not generated
    plan: ShardPlan | None = None     # the driver's plan (gamma and prior per task); None: the actor's own


@dataclass
class ShardResult:
    table: pa.Table | None            # the shard's output rows, in input order; None once committed
    stats_rows: list[dict] = field(default_factory=list)   # one per task in the shard
    num_rows: int | None = None       # output rows (set when the table was committed by the actor)
    costs: dict | None = None         # the actor's cost evidence for the driver's plans (plan_stats.py)


def commit_result(task: ShardTask, result: ShardResult) -> ShardResult:
    """Commit the shard's part to `task.output_dir` from where it was generated (the actor),
    and hand back only its stats: output rows never travel through the driver."""
    if task.probe is not None:            # a probe only tells whether its rows can be generated
        return ShardResult(None, [], result.table.num_rows, result.costs)
    if task.output_dir is None or result.table is None:
        return result
    table = result.table
    if table.num_rows != task.shard.num_rows:
        raise RuntimeError(f"shard {task.shard.shard_id}: {table.num_rows} output rows for "
                           f"{task.shard.num_rows} input rows")
    commit_part(task.output_dir, task.shard.shard_id, table, result.stats_rows)
    return ShardResult(None, result.stats_rows, table.num_rows, result.costs)


def row_key(row_id) -> int:
    """A stable int64 random-stream key for a row id: the engine draws a row's randomness from
    (sampling.seed, key, position), so sampled text does not depend on shard layout or retries."""
    if isinstance(row_id, int) and -(2**63) <= row_id < 2**63:
        return row_id
    digest = hashlib.blake2b(repr(row_id).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


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


def gamma_in_use(engine_stats: Any, gamma: int | str, policy: Any = None) -> dict:
    """The stats row's gamma fields. A fixed gamma is the config's. For 'auto': the gamma the
    policy chose most often once calibrated (calibration steps, and steps measuring plain
    decoding, are counted, not chosen), its reasoning, and the candidates with their
    predicted goodput from that decision."""
    if gamma != "auto":
        return {"gamma": int(gamma), "gamma_reason": f"fixed by config (spec.gamma={gamma})",
                "gamma_candidates": [], "predicted_goodput": []}
    used = Counter(getattr(s, "gamma", None) for s in getattr(engine_stats, "steps", []) or [])
    used.pop(None, None)
    chosen = used.most_common(1)[0][0] if used else None
    decisions = list(getattr(policy, "decisions", []) or [])
    decided = [d for d in decisions if d.predicted_goodput and not getattr(d, "measuring", False)]
    if not decided:
        reason = getattr(policy, "reason", None) or (decisions[-1].reason if decisions else "no steps")
        return {"gamma": chosen, "gamma_reason": f"auto: {reason}", "gamma_candidates": [], "predicted_goodput": []}
    chosen = Counter(d.gamma for d in decided).most_common(1)[0][0]
    rep = next(d for d in decided if d.gamma == chosen)
    notes = [f"auto: {rep.reason}"]
    calibrating = sum(1 for d in decisions if getattr(d, "calibrating", not d.predicted_goodput))
    if calibrating:
        notes.append(f"{calibrating} calibration steps at gamma_max")
    measuring = sum(1 for d in decisions if getattr(d, "measuring", False))
    if measuring:
        notes.append(f"{measuring} steps measuring plain decoding (at new shapes, or again where its price had aged)")
    if len(used) > 1:
        notes.append("steps per gamma " + ", ".join(f"{g}:{n}" for g, n in sorted(used.items())))
    return {"gamma": chosen, "gamma_reason": "; ".join(notes), "gamma_candidates": rep.candidates,
            "predicted_goodput": [round(x, 1) for x in rep.predicted_goodput]}


def _finite(x: float) -> float | None:
    """NaN (nothing measured, e.g. no verify step) is stored as null."""
    x = float(x)
    return None if x != x else x


def source_kwargs(engine: Any, draft: str, task: str | None) -> dict:
    """`draft=` and `task=` for engine.generate, where it takes them (the n-gram source searches
    the task's earlier outputs on this actor). An engine without them drafts as it always did."""
    params = inspect.signature(engine.generate).parameters
    out = {}
    if "draft" in params:
        out["draft"] = draft
    if "task" in params:
        out["task"] = task
    return out


def source_stats(stats: Any) -> dict:
    """The stats row's per-source maps: draft tokens verified and accepted, by source."""
    return {"drafted_by_source": dict(getattr(stats, "drafted_by_source", {}) or {}),
            "accepted_by_source": dict(getattr(stats, "accepted_by_source", {}) or {})}


def generate_group(engine: Any, prompts: list[str], keys: list[int], sampling: SamplingParams,
                   gamma: int | str, info: dict, prior: Any = None,
                   plan: TaskPlan | None = None, draft: str = "auto",
                   task: str | None = None) -> tuple[list[dict], dict, Any]:
    """One generate call; per-row results, the measured part of the stats row, and the call's
    acceptance counters (the prior for this task's next shard on this actor).

    With gamma 'auto' the engine's measured policy chooses every step, seeded with the plan's
    prior (else `prior`, this actor's own); without enough evidence it calibrates at gamma_max
    first, where the plan lets it (pipeline.spec_decode.evidence)."""
    policy = gamma
    if plan is not None:
        prior = plan.prior()
    if gamma == "auto" and "mtp" in getattr(engine, "draft_names", ()) and hasattr(engine, "auto_policy"):
        policy = (engine.auto_policy(prior=prior) if plan is None else
                  engine.auto_policy(prior=prior, planned=plan.gamma, calibrate=plan.calibrate, rows=len(prompts)))
    wall0 = time.perf_counter()
    with UtilizationMeter(info.get("device", "cpu"), int(info.get("threads", 1))) as meter:
        outs = engine.generate(prompts, sampling, gamma=policy, row_keys=keys, **source_kwargs(engine, draft, task))
    wall = time.perf_counter() - wall0
    if hasattr(engine, "note_utilization"):
        engine.note_utilization(meter.value)       # a large change re-profiles before the next shard
    results = [output_result(o) for o in outs]
    stats = engine.last_stats
    generated = sum(r["num_generated_tokens"] for r in results)
    model = shard_cost_model(engine, stats.steps)
    measured = {
        **gamma_in_use(stats, gamma, getattr(engine, "last_policy", None)),
        "acceptance_by_depth": [_finite(a) for a in getattr(stats, "acceptance_by_depth_all_sources",
                                                             stats.acceptance_by_depth)()],
        "mean_acceptance_length": _finite(stats.mean_acceptance_length()),
        "tokens_per_s": generated / wall if wall > 0 else None,
        "draft_time_s": float(stats.draft_time_s), "verify_time_s": float(stats.verify_time_s),
        "host_time_s": _finite(getattr(stats, "host_time_s", float("nan"))),   # gamma choice, emits, stop checks
        "utilization": meter.value, "num_generated_tokens": generated, **source_stats(stats),
        "cost_samples": cost_samples(stats.steps),      # for the dashboard's cost-model plot
        "cost_model": cost_model_json(model),
        "predicted_goodput_gamma0": predicted_gamma0_tokens_per_s(stats.steps, model, generated, wall),
        **plan_fields(stats, getattr(engine, "last_policy", None), plan, gamma, prior),
    }
    counts = stats.counts() if hasattr(stats, "counts") else None
    return results, measured, counts


def apply_spec(engine: Any, gamma_max: int, draft_window: int | None) -> None:
    """spec.gamma_max and spec.draft_window onto an engine that has them (a custom loader's may
    not); draft_window None leaves the checkpoint's."""
    if hasattr(engine, "gamma_max"):
        engine.gamma_max = gamma_max
    if draft_window is not None and hasattr(engine, "draft_window"):
        engine.draft_window = draft_window


def process_shard(engine: Any, task: ShardTask, info: dict | None = None,
                  priors: dict | None = None) -> ShardResult:
    """Generate every row of `task.shard`; info carries device, actor_id, node_id, threads.
    `priors` (task -> acceptance counters) persists across an actor's shards."""
    info = info or {}
    priors = {} if priors is None else priors
    apply_spec(engine, task.gamma_max, task.draft_window)
    table = read_task_rows(task)
    prompts, errors = build_prompts(table, task.data)
    for i, why in task.bad_rows:
        errors[i] = why
    results: list[dict | None] = [None] * table.num_rows
    stats_rows = []
    ids = row_ids(table, task.data)
    id_values = ids.to_pylist()
    for name, rows in group_by_task(row_tasks(table, task.data)).items():
        for i in rows:
            if errors[i] is not None:
                results[i] = error_results(1, errors[i])[0]
        good = [i for i in rows if errors[i] is None]
        group_start, started_at = time.perf_counter(), time.time()
        measured: dict = {"gamma_reason": "no rows to generate", "num_generated_tokens": 0}
        if good:
            outs, measured, counts = generate_group(
                engine, [prompts[i] for i in good], [row_key(id_values[i]) for i in good], task.sampling,
                task.gamma, info, priors.get(name), task.plan.for_task(name) if task.plan else None,
                task.draft, name)
            if counts is not None:
                priors[name] = counts if name not in priors else priors[name].merge(counts)
            for i, r in zip(good, outs):
                results[i] = r
        stats_rows.append(measured | {
            "shard_id": task.shard.shard_id, "task": name, "num_rows": len(rows),
            "num_errors": sum(1 for i in rows if results[i]["error"] is not None),
            "wall_time_s": time.perf_counter() - group_start, "attempt": task.attempt,
            "started_at": started_at, "finished_at": time.time(),
            "device": info.get("device"), "actor_id": info.get("actor_id"),
            "node_id": info.get("node_id"),
        })
    keep = table.select(list(task.keep_columns)) if task.keep_columns else None
    out = output_table(ids, prompts, results, keep)
    return ShardResult(out, stats_rows, costs=actor_costs(engine, info, stats_rows))


def read_task_rows(task: ShardTask) -> pa.Table:
    """The task's input rows (the probe's slice of the shard); an input that cannot be read is
    a UserError naming the rows and files, which stops the run (no retry reads it better)."""
    try:
        table = read_shard(task.files, task.file_rows, task.shard,
                           needed_columns(task.data, task.keep_columns),
                           task.data.task_column, task.data.tasks)
    except (OSError, ValueError, pa.ArrowException) as exc:
        files = [f for f, start, n in _file_spans(task) if start < task.shard.stop and start + n > task.shard.start]
        raise UserError(f"cannot read rows [{task.shard.start}, {task.shard.stop}) of data.path "
                        f"(in {files}): {exc}") from None
    if task.probe is not None:
        lo, hi = task.probe
        table = table.slice(lo, hi - lo)
    return table


def _file_spans(task: ShardTask):
    start = 0
    for f, n in zip(task.files, task.file_rows):
        yield f, start, n
        start += n


def failed_shard_result(task: ShardTask, message: str) -> ShardResult:
    """Output rows for a shard that failed every attempt: each row carries the error."""
    table = read_task_rows(task)
    prompts, _ = build_prompts(table, task.data)
    keep = table.select(list(task.keep_columns)) if task.keep_columns else None
    out = output_table(row_ids(table, task.data), prompts,
                       error_results(table.num_rows, message), keep)
    stats_rows = [{"shard_id": task.shard.shard_id, "task": name, "num_rows": len(rows),
                   "num_errors": len(rows), "num_generated_tokens": 0, "attempt": task.attempt,
                   "finished_at": time.time(),
                   "gamma_reason": f"failed: {message}"[:500]}
                  for name, rows in group_by_task(row_tasks(table, task.data)).items()]
    return ShardResult(out, stats_rows)
