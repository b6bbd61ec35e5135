"""The plan's side of a shard's stats, and the actor's cost evidence the driver plans from.

`plan_fields` gives a task's stats row what DESIGN.md names: `planned_gamma` (the driver's plan;
a fixed gamma is its own plan), `gamma_steps` (verify steps per gamma, index = gamma),
`calibration_steps`, `prior_row_steps` and `prior_source` (the evidence the policy started
from), and the per-depth counts `reached_by_depth` / `accepted_by_depth` that the driver
merges into the run's evidence (and `spec.prior=RUN_DIR` reads back).

`actor_costs` is what travels back with a shard's result for the driver's next plans: the
actor's cost model (without its per-shape correction, which only the actor can use), its
utilisation over the shard, its batch size and the mean context of its steps.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from pipeline.spec_decode.cost import CostModel


def gamma_steps(steps) -> list[int]:
    """Steps per gamma: [steps at gamma 0, at gamma 1, ...]."""
    counts: list[int] = []
    for s in steps or ():
        g = getattr(s, "gamma", None)
        if isinstance(g, int) and g >= 0:
            counts += [0] * (g + 1 - len(counts))
            counts[g] += 1
    return counts


def _row_steps(prior: Any) -> int:
    reached = getattr(prior, "reached", None) or [0]
    return int(reached[0])


def plan_fields(stats: Any, policy: Any, plan: Any, gamma: int | str, prior: Any = None) -> dict:
    """The plan columns of a task's stats row (module docstring)."""
    decisions = getattr(policy, "decisions", None) or []
    used_prior = getattr(policy, "prior", None)
    given = _row_steps(prior)
    start = _row_steps(used_prior) if used_prior is not None else given
    if plan is not None:
        source = plan.source if plan.prior_row_steps else "none"
    else:
        source = "this actor's earlier shards" if given else "none"
    if start > given:                                    # the engine added the checkpoint's prior
        source = "spec_prior.json" if source == "none" else f"{source} + spec_prior.json"
    planned = int(gamma) if gamma != "auto" else (plan.gamma if plan is not None else None)
    return {
        "planned_gamma": planned,
        "gamma_steps": gamma_steps(getattr(stats, "steps", None)),
        "calibration_steps": sum(1 for d in decisions if getattr(d, "calibrating", not getattr(d, "predicted_goodput", 1))),
        "prior_row_steps": start if gamma == "auto" else 0,
        "prior_source": source if gamma == "auto" else "none (fixed gamma)",
        "reached_by_depth": [int(x) for x in getattr(stats, "reached", None) or []],
        "accepted_by_depth": [int(x) for x in getattr(stats, "accepted", None) or []],
    }


def actor_costs(engine: Any, info: dict, stats_rows: list[dict]) -> dict | None:
    """The actor's cost evidence after a shard; None from an engine without a cost model."""
    model = None
    if callable(getattr(engine, "cost_model", None)) and "mtp" in getattr(engine, "draft_names", ()):
        costs = getattr(engine, "costs", None)
        if costs is not None and getattr(costs, "profile", None):
            try:
                model = engine.cost_model()
            except Exception:         # a failed fit: the driver plans without this actor's costs
                model = None
    if not isinstance(model, CostModel):
        model = None
    utils = [r["utilization"] for r in stats_rows if r.get("utilization") is not None]
    steps = [s for s in getattr(getattr(engine, "last_stats", None), "steps", None) or [] if hasattr(s, "context_len")]
    ctx = sum(s.context_len for s in steps[-64:]) / len(steps[-64:]) if steps else None
    return {"actor_id": info.get("actor_id"), "device": str(info.get("device", "cpu")),
            "model": dataclasses.replace(model, local=None) if model is not None else None,
            "utilization": utils[-1] if utils else None,
            "batch": int(getattr(engine, "max_batch_size", 32) or 32), "context_len": ctx}
