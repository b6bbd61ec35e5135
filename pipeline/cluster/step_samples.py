"""Compact cost-model evidence for a shard's stats row, so the dashboard can draw the fit.

`cost_model_json` is the fitted cost model the shard ran with (`CostModel.to_dict`, as JSON).
`cost_samples` keeps at most `cap` of a generate call's verify steps, evenly spaced, as
[rows, query_len, context_len, verify_s, draft_s] (query_len = gamma + 1).

`predicted_gamma0_tokens_per_s` answers "what would this shard have done without speculation?"
from the fitted cost model. Each measured step emitted `emitted` tokens over `rows` rows; at
gamma 0 every row emits one token per step, so the same tokens take emitted / rows steps of
verify_s(rows, 1, ctx) each and no draft time. The model (fitted at start-up and over earlier
steps) is first scaled by this shard's measured / predicted verify time, so the prediction is
for the device as it was during the shard (a co-tenant, clocks, warm-up). Prefill and other
overhead are kept as measured:

    scale = sum(verify_s) / sum(model.verify_s(rows, gamma + 1, ctx))        over the steps
    predicted_wall = wall - sum(verify_s + draft_s) + scale * sum(emitted / rows * model.verify_s(rows, 1, ctx))
    predicted tokens/s = generated / predicted_wall

Worked example: a shard's generate call took 2.0 s for 100 tokens, from 20 steps of 4 rows at
gamma 2, each 0.06 s verify + 0.02 s draft with 5 tokens emitted (decode 1.6 s). The model says
verify_s = 0.04 + 0.005 N: 0.1 s at N = 4 x 3, so scale = 0.6; at gamma 0, N = 4: 0.06 s,
scaled 0.036 s. The same 100 tokens need 20 * 5 / 4 = 25 steps = 0.9 s, so the prediction is
100 / (2.0 - 1.6 + 0.9) = 76.9 tokens/s against the measured 50: speculation lost here.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from pipeline.spec_decode.cost import CostModel, fit_cost_model


_FIELDS = ("rows", "query_len", "context_len", "verify_s", "draft_s", "emitted")


def measured_steps(steps: Sequence[Any]) -> list[Any]:
    """The StepRecord-like entries (a stand-in engine may record less)."""
    return [s for s in steps or () if all(hasattr(s, f) for f in _FIELDS) and s.rows > 0]


def cost_samples(steps: Sequence[Any], cap: int = 64) -> list[list[float]]:
    """[[rows, query_len, context_len, verify_s, draft_s], ...], at most `cap`, evenly spaced."""
    steps = measured_steps(steps)
    if len(steps) > cap:
        stride = len(steps) / cap
        steps = [steps[int(i * stride)] for i in range(cap)]
    return [[int(s.rows), int(s.query_len), round(float(s.context_len), 1),
             float(s.verify_s), float(s.draft_s)] for s in steps]


def shard_cost_model(engine: Any, steps: Sequence[Any]) -> CostModel | None:
    """The engine's fitted model (start-up profile + measured steps) where it has one, else a
    fit over this call's steps alone (None when they hold fewer than 3 shapes)."""
    model = None
    if callable(getattr(engine, "cost_model", None)):
        try:
            model = engine.cost_model()
        except Exception:      # a stand-in engine or a failed fit: fall back to the steps
            model = None
    if not isinstance(model, CostModel):
        steps = measured_steps(steps)
        model = fit_cost_model(steps) if steps else None
    return model


def cost_model_json(model: CostModel | None) -> str | None:
    """The model as JSON of `CostModel.to_dict()` (the dashboard rebuilds it with `from_dict`)."""
    return None if model is None else json.dumps(model.to_dict())


def predicted_gamma0_tokens_per_s(steps: Sequence[Any], model: CostModel | None,
                                  generated: int, wall_s: float) -> float | None:
    """Predicted tokens/s of the same work at gamma 0 (module docstring); None without a model
    or steps."""
    steps = measured_steps(steps)
    if model is None or not steps or generated <= 0 or wall_s <= 0:
        return None
    measured = sum(s.verify_s + s.draft_s for s in steps)
    modelled = sum(model.verify_s(s.rows, s.query_len, s.context_len) for s in steps)
    scale = sum(s.verify_s for s in steps) / modelled if modelled > 0 else 1.0
    at_gamma0 = scale * sum(s.emitted / s.rows * model.verify_s(s.rows, 1, s.context_len) for s in steps)
    predicted_wall = wall_s - measured + at_gamma0
    return generated / predicted_wall if predicted_wall > 0 else None
