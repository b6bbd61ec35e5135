"""The run's evidence, kept by the driver, and the plan it makes from it for each shard.

Evidence: per task, per-depth acceptance counts (reached, accepted) merged from every committed
shard's stats rows (`reached_by_depth`, `accepted_by_depth`), on top of a prior (the heads'
`spec_prior.json`, or an earlier run's stats via `spec.prior`); per actor, its last cost model
and the utilisation it measured.

Calibration once per run: a task with less than `calibration_rows` row-steps of evidence is
calibrated (gamma_max for a window, pipeline.spec_decode.policy) by one shard at a time. The
shard planned first holds the lease for its tasks (and for tasks nobody has seen: the driver
only learns a shard's tasks from its stats); a shard planned while the lease is held starts
from whatever evidence there is and runs the planned gamma (0 with none) rather than
calibrating from scratch beside it. The lease is given back when the shard commits or fails;
by then its evidence is merged, so the next shard of that task starts calibrated.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.spec_decode.cost import CostModel
from pipeline.spec_decode.plan import (ShardPlan, TaskPlan, available_share, busy_model, plan_gamma,
                                       scaled_counts)

UNSEEN = "\x00unseen"       # the lease key for tasks no shard has reported yet
PRIOR_ROW_STEPS = 512       # a prior from a file or an earlier run weighs at most this many row-steps


@dataclass
class ActorCosts:
    model: CostModel | None
    utilization: float | None = None     # over its last shard
    baseline: float | None = None        # when its cost model was measured (its first report)
    device: str = "cpu"
    batch: int = 32                      # engine.max_batch_size
    context_len: float = 128.0           # context of its recent steps (StepRecord.context_len)


@dataclass
class TaskEvidence:
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    source: str = "none"                 # where the evidence started from

    def add(self, reached, accepted) -> None:
        n = max(len(self.reached), len(reached or ()))
        pad = lambda xs: list(xs or ()) + [0] * (n - len(xs or ()))  # noqa: E731
        self.reached = [a + b for a, b in zip(pad(self.reached), pad(reached))]
        self.accepted = [a + b for a, b in zip(pad(self.accepted), pad(accepted))]


class RunEvidence:
    def __init__(self, gamma_max: int, calibration_rows: int = 256, min_gain: float = 0.05):
        self.gamma_max, self.calibration_rows, self.min_gain = gamma_max, calibration_rows, min_gain
        self.tasks: dict[str, TaskEvidence] = {}
        self.pooled = TaskEvidence(source="none")  # every task together: the plan for an unseen one
        self.actors: dict[str, ActorCosts] = {}
        self.leases: dict[str, int] = {}           # task (or UNSEEN) -> shard calibrating it

    # ---- evidence in ------------------------------------------------------------------------
    def add_prior(self, priors: dict[str, tuple[list[int], list[int]]], source: str) -> None:
        """Per-task (reached, accepted) from a file or an earlier run, each capped at
        PRIOR_ROW_STEPS row-steps; "*" (or every task pooled) is the prior of unseen tasks."""
        for name, (reached, accepted) in priors.items():
            r, a = scaled_counts(reached, accepted, PRIOR_ROW_STEPS)
            ev = self.pooled if name == "*" else self.tasks.setdefault(name, TaskEvidence(source=source))
            ev.add(r, a)
            ev.source = source
        if "*" not in priors and priors:
            for name, (reached, accepted) in priors.items():
                self.pooled.add(*scaled_counts(reached, accepted, PRIOR_ROW_STEPS // max(len(priors), 1)))
            self.pooled.source = source

    def observe_rows(self, stats_rows) -> None:
        """Merge a committed shard's stats rows (one per task) into the evidence."""
        for r in stats_rows:
            reached, accepted = r.get("reached_by_depth"), r.get("accepted_by_depth")
            if not reached or r.get("task") is None:
                continue
            ev = self.tasks.setdefault(r["task"], TaskEvidence(source="this run"))
            ev.add(reached, accepted)
            if "this run" not in ev.source:
                ev.source = "this run" if ev.source == "none" else f"{ev.source} + this run"

    def observe_actor(self, actor_id: str, model: CostModel | None, utilization: float | None,
                      device: str = "cpu", batch: int = 32, context_len: float | None = None) -> None:
        """An actor's cost model and the utilisation over its last shard. The first report sets
        the baseline its cost model was measured under."""
        prev = self.actors.get(actor_id)
        baseline = prev.baseline if prev is not None and prev.baseline is not None else utilization
        self.actors[actor_id] = ActorCosts(model if model is not None else (prev.model if prev else None),
                                           utilization, baseline, device, batch,
                                           context_len or (prev.context_len if prev else 128.0))

    def release(self, shard_id: int) -> None:
        """The shard committed or failed: its calibration leases are free again."""
        self.leases = {k: v for k, v in self.leases.items() if v != shard_id}

    # ---- plan out ---------------------------------------------------------------------------
    def plan(self, shard_id: int, actor_id: str | None, rows: int) -> ShardPlan:
        """The plan for `shard_id` (`rows` rows) on `actor_id` (module docstring)."""
        actor = self.actors.get(actor_id) if actor_id is not None else None
        tasks = {name: self._task_plan(shard_id, name, ev, actor, rows) for name, ev in self.tasks.items()}
        unseen = self._task_plan(shard_id, UNSEEN, self.pooled, actor, rows)
        return ShardPlan(tasks, unseen, self.gamma_max)

    def _task_plan(self, shard_id: int, key: str, ev: TaskEvidence, actor: ActorCosts | None,
                   rows: int) -> TaskPlan:
        model = None
        notes = []
        if actor is not None and actor.model is not None:
            available = available_share(actor.utilization, actor.baseline, actor.device)
            model = busy_model(actor.model, available)
            if available < 1.0:
                notes.append(f"device busy: {available:.0%} of it available")
        gamma, reason = plan_gamma(model, ev.reached, ev.accepted, min(rows, actor.batch if actor else rows),
                                   actor.context_len if actor else 128.0, self.gamma_max, self.min_gain)
        seen = ev.reached[0] if ev.reached else 0
        calibrate = True
        if seen < self.calibration_rows and self.gamma_max > 0:
            holder = self.leases.setdefault(key, shard_id)
            calibrate = holder == shard_id
            if not calibrate:
                notes.append(f"calibration under way in shard {holder}")
        return TaskPlan(gamma, tuple(ev.reached), tuple(ev.accepted), calibrate, ev.source,
                        "; ".join([reason, *notes]))
