"""The driver's planner: keeps the run's evidence (pipeline.spec_decode.evidence) and makes the
plan each shard is sent with.

Evidence comes from the prior (`spec.prior`: an earlier run's directory or a spec_prior.json;
by default the checkpoint's own spec_prior.json), the committed shards of this run (on resume
too), and each shard that commits; each actor's cost model and utilisation come back with its
results. With a fixed `spec.gamma` there is nothing to plan: shards go without a plan.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pipeline.config import RunConfig
from pipeline.data.commit import committed_shards, part_stats
from pipeline.model.spec_prior import read_spec_prior
from pipeline.spec_decode.evidence import RunEvidence
from pipeline.spec_decode.plan import ShardPlan


def actor_key(actor: Any) -> str | None:
    """The id an actor reports as `actor_id` (ctx.get_actor_id()), from its handle."""
    ident = getattr(actor, "_actor_id", None)
    return ident.hex() if ident is not None else None


def run_counts(run_dir: str) -> dict[str, tuple[list[int], list[int]]]:
    """Per task, the per-depth counts summed over an earlier run's committed shards."""
    ev = RunEvidence(gamma_max=0)
    for path in committed_shards(run_dir).values():
        ev.observe_rows(part_stats(str(path)))
    return {name: (t.reached, t.accepted) for name, t in ev.tasks.items() if t.reached}


def load_prior(cfg: RunConfig) -> tuple[dict, str]:
    """(task -> counts, source) from `spec.prior`, else the checkpoint's spec_prior.json."""
    where = cfg.spec.prior
    if where is None:
        model = Path(cfg.model.path)
        tasks = read_spec_prior(model) if model.is_dir() else None
        return (tasks or {}), ("checkpoint spec_prior.json" if tasks else "none")
    tasks = read_spec_prior(where)
    if tasks:
        return tasks, f"spec.prior {where}"
    counts = run_counts(where) if Path(where, "outputs").is_dir() or "://" in where else {}
    if not counts:
        print(f"warning: spec.prior={where} holds no acceptance evidence (no spec_prior.json, no "
              "committed shards with per-depth counts); starting without a prior", file=sys.stderr)
    return counts, f"run {where}"


class Planner:
    def __init__(self, cfg: RunConfig, stats_rows=()):
        self.auto = cfg.spec.gamma == "auto"
        self.rows_per_shard = cfg.shards.rows_per_shard
        self.evidence = RunEvidence(cfg.spec.gamma_max)
        if self.auto:
            tasks, source = load_prior(cfg)
            if tasks:
                self.evidence.add_prior(tasks, source)
            self.evidence.observe_rows(stats_rows)          # a resumed run's committed shards

    def plan(self, shard_id: int, num_rows: int, actor: Any) -> ShardPlan | None:
        if not self.auto:
            return None
        return self.evidence.plan(shard_id, actor_key(actor), num_rows)

    def done(self, shard_id: int, stats_rows, costs: dict | None, committed: bool) -> None:
        if committed:
            self.evidence.observe_rows(stats_rows)
        if costs and costs.get("actor_id"):
            self.evidence.observe_actor(costs["actor_id"], costs.get("model"), costs.get("utilization"),
                                        costs.get("device", "cpu"), costs.get("batch", 32), costs.get("context_len"))
        self.evidence.release(shard_id)

    def failed(self, shard_id: int) -> None:
        self.evidence.release(shard_id)
