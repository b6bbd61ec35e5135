"""The driver: plan shards, run them on a Ray actor pool, commit as they finish.

`open_job(cfg)` checks everything and opens the run directory; `run_job` runs its shards (it
starts Ray when `cluster.address` is null and stops it at the end); the `generate` recipe
(pipeline/recipes.py) calls both and then draws the dashboard. `run_generation(cfg, resolved)`
is the library function and expects Ray to be running.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from pipeline.config import ClusterConfig, RunConfig, UserError
from pipeline.data.record import RunRecord, open_run
from pipeline.data.storage import is_uri
from pipeline.cluster.actor import Loader, actor_options, load_engine, start_actor
from pipeline.cluster.metrics import RunMetrics
from pipeline.cluster.narrow import Retries, Try, failures_tolerated
from pipeline.cluster.planner import Planner
from pipeline.cluster.pool import ActorPool, ActorsKeepDying
from pipeline.cluster.progress import Progress
from pipeline.cluster.worker import ShardResult, ShardTask, failed_shard_result

DEMO_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo"
BUILD_DEMO = "python -m pipeline.run +job=build_demo"


def check_inputs(cfg: RunConfig) -> None:
    """Clear errors for a missing model or dataset, naming how to build the demo ones.

    URIs are checked where they are opened (a model URI by each node, model_files.py). On a
    cluster a local model.path the driver's node lacks is only a warning: the actors' nodes may
    have it, and an actor whose node does not fails naming its node and the path."""
    for key, path, need in (("model.path", cfg.model.path, "config.json"),
                            ("data.path", cfg.data.path, None)):
        if any(c in path for c in "*?[") or is_uri(path):
            continue
        if key == "model.path" and cfg.cluster.address is not None:
            if not (Path(path) / need).is_file():
                print(f"warning: model.path {path} is not on the driver's node; each actor "
                      "checks its own node", file=sys.stderr)
            continue
        p = Path(path)
        if p.exists() and (need is None or (p / need).is_file()):
            continue
        problem = f"{path} has no {need}" if p.exists() else f"{path} does not exist"
        hint = (f"; the demo assets are built with `{BUILD_DEMO}`"
                if p.resolve().is_relative_to(DEMO_DIR) else "")
        raise UserError(f"{key} {problem}{hint}")


def start_ray(cluster: ClusterConfig) -> bool:
    """Start (address null) or join Ray; True when this call started it (and must stop it)."""
    if ray.is_initialized():
        return False
    if cluster.address is None:
        need = cluster.num_actors * cluster.cpus_per_actor
        ray.init(num_cpus=max(os.cpu_count() or 1, need), include_dashboard=False,
                 logging_level="warning")
    else:
        ray.init(address=cluster.address, logging_level="warning")
    return True


def open_job(cfg: DictConfig) -> tuple[RunConfig, RunRecord]:
    """The job's validated config and its opened run directory: every input check, before Ray
    starts (a problem is a UserError or ConfigError and nothing has been written)."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved.pop("hydra", None)
    run_cfg = RunConfig.from_dict(resolved)
    check_inputs(run_cfg)
    return run_cfg, open_run(run_cfg, resolved)


def run_job(run_cfg: RunConfig, record: RunRecord) -> int:
    """Run the opened job's pending shards on Ray (started here when `cluster.address` is null,
    and stopped again); the exit status."""
    started = start_ray(run_cfg.cluster)
    try:
        manifest = run_generation(run_cfg, {}, record=record)
    except ActorsKeepDying as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if started:
            ray.shutdown()
    t = manifest["totals"]
    print(f"{manifest['status']}: {t['rows']} rows ({t['rows_with_error']} with errors), "
          f"{t['generated_tokens']} tokens -> {run_cfg.output.dir}", file=sys.stderr)
    return 0 if manifest["status"] == "finished" else 1


def main(cfg: DictConfig) -> int:
    """`open_job` then `run_job` (the `generate` recipe also draws the dashboard after them)."""
    return run_job(*open_job(cfg))


def _use_gpus(cfg: RunConfig) -> bool:
    return cfg.model.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0


def pool_size(cfg: RunConfig, use_gpus: bool, pending: int) -> int:
    """Actors to start: cluster.num_actors, but no more than there are shards, nor more than
    the cluster's resources hold (an actor that can never be placed would wait forever)."""
    total = ray.cluster_resources()
    fit = (total.get("GPU", 0) // cfg.cluster.gpus_per_actor if use_gpus
           else total.get("CPU", 0) // cfg.cluster.cpus_per_actor)
    size = min(cfg.cluster.num_actors, pending)
    if fit < size:
        kind = "GPU" if use_gpus else "CPU"
        print(f"warning: cluster.num_actors={cfg.cluster.num_actors} but the cluster has "
              f"{total.get(kind, 0):g} {kind}s for {int(fit)} actor(s); starting "
              f"{max(int(fit), 1)}", file=sys.stderr)
        size = max(int(fit), 1)
    return size


def run_generation(cfg: RunConfig, resolved: dict[str, Any], progress: bool = True,
                   loader: str | Loader = load_engine, record: RunRecord | None = None) -> dict:
    """Run every pending shard of `cfg` on a pool of actors; returns the final manifest.
    `loader(model_cfg, engine_cfg)` builds each actor's engine (default: Engine.from_pretrained);
    `record`: the run as `open_run(cfg, resolved)` opened it (opened here when None)."""
    if not ray.is_initialized():
        raise RuntimeError("Ray is not running: start it first (pipeline.cluster.driver.main does)")
    record = record or open_run(cfg, resolved)
    pending = record.pending()
    if not pending:
        record.save("finished")
        return record.manifest
    use_gpus = _use_gpus(cfg)
    options = actor_options(use_gpus, cfg.cluster.gpus_per_actor, cfg.cluster.cpus_per_actor)
    size = pool_size(cfg, use_gpus, len(pending))
    pool = ActorPool(lambda: start_actor(cfg.model, cfg.engine, options, loader), size,
                     failures_tolerated(size, cfg.shards.max_attempts, cfg.shards.rows_per_shard))
    retries = Retries(cfg.shards.max_attempts)
    bar = Progress(record.total_rows, record.done_rows, enabled=progress)
    metrics = RunMetrics(str(record.run_dir).rstrip("/").rsplit("/", 1)[-1])
    planner = Planner(cfg, record.committed_stats())
    status = "failed"
    try:
        pool.wait_ready()
        pool.run([retries.first(s) for s in pending],
                 lambda t, actor: _task(cfg, record, t, planner.plan(t.shard.shard_id, t.shard.num_rows, actor)),
                 lambda t, result: _done(record, bar, retries, t, result, metrics, planner),
                 lambda t, why: _failed(cfg, record, bar, retries, t, why, metrics, planner))
        status = "finished"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        bar.close()
        pool.shutdown()
        record.save(status)
    return record.manifest


def _task(cfg: RunConfig, record: RunRecord, t: Try, plan=None) -> ShardTask:
    record.attempts[t.shard.shard_id] = t.attempt
    return ShardTask(shard=t.shard, attempt=t.attempt, files=record.source.files,
                     file_rows=record.source.file_rows, data=cfg.data,
                     keep_columns=cfg.output.keep_columns, sampling=cfg.sampling,
                     gamma=cfg.spec.gamma, gamma_max=cfg.spec.gamma_max, draft=cfg.spec.draft,
                     draft_window=cfg.spec.draft_window, output_dir=record.output_dir, probe=t.probe, bad_rows=t.bad_rows, plan=plan)


def _done(record: RunRecord, bar: Progress, retries: Retries, t: Try, result: ShardResult,
          metrics: RunMetrics | None, planner: Planner | None = None) -> list[Try]:
    if t.probe is None:
        _commit(record, bar, t.shard, t.attempt, result, metrics)
    if planner is not None:
        planner.done(t.shard.shard_id, result.stats_rows, result.costs, committed=t.probe is None)
    return retries.passed(t)


def _failed(cfg: RunConfig, record: RunRecord, bar: Progress, retries: Retries, t: Try,
            why: str, metrics: RunMetrics | None, planner: Planner | None = None) -> list[Try]:
    if planner is not None:
        planner.failed(t.shard.shard_id)
    follow = retries.failed(t, why)
    if follow is None:
        _give_up(cfg, record, bar, t, why, metrics)
        return []
    return follow


def _commit(record: RunRecord, bar: Progress, shard, attempt: int, result: ShardResult,
            metrics: RunMetrics | None = None) -> None:
    if result.table is None:      # the actor committed the part itself (the usual case)
        record.mark_committed(shard, result.num_rows, result.stats_rows)
    else:
        record.commit(shard, result.table, result.stats_rows)
    bar.update(shard.num_rows, result.stats_rows, record.totals())
    if metrics is not None:
        metrics.observe(result.stats_rows, record.totals())


def _give_up(cfg: RunConfig, record: RunRecord, bar: Progress, t: Try, why: str,
             metrics: RunMetrics | None = None) -> None:
    """Every row of the shard is written with `why`: no row is dropped."""
    whole = Try(t.shard, t.attempt)
    result = failed_shard_result(_task(cfg, record, whole), why)
    _commit(record, bar, t.shard, t.attempt, result, metrics)
