"""Compact cost-model evidence for a shard's stats row, so the dashboard can draw the fit.

`cost_samples` keeps at most `cap` of a generate call's verify steps, evenly spaced, as
[rows, query_len, context_len, verify_s, draft_s] (query_len = gamma + 1).

`predicted_gamma0_tokens_per_s` answers "what would this shard have done without speculation?"
from the fitted cost model. Each measured step emitted `emitted` tokens over `rows` rows; at
gamma 0 every row emits one token per step, so the same tokens take emitted / rows steps of
verify_s(rows, 1, ctx) each and no draft time. Prefill and other overhead are kept as measured:

    predicted_wall = wall - sum(verify_s + draft_s) + sum(emitted / rows * verify_s(rows, 1, ctx))
    predicted tokens/s = generated / predicted_wall

Worked example: one shard, wall 2.0 s, 100 tokens from 20 steps of 4 rows at gamma 2 (each
step 0.06 s verify + 0.02 s draft, 5 tokens emitted): decode took 1.6 s. If the model says
verify_s(4, 1, ctx) = 0.05 s, gamma 0 needs 20 * 5 / 4 = 25 steps = 1.25 s, so the prediction
is 100 / (2.0 - 1.6 + 1.25) = 60.6 tokens/s against the measured 50.
"""
from __future__ import annotations

from typing import Any, Sequence

from pipeline.spec.cost import CostModel, fit_cost_model


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


def predicted_gamma0_tokens_per_s(steps: Sequence[Any], model: CostModel | None,
                                  generated: int, wall_s: float) -> float | None:
    """Predicted tokens/s of the same work at gamma 0 (module docstring); None without a model
    or steps."""
    steps = measured_steps(steps)
    if model is None or not steps or generated <= 0 or wall_s <= 0:
        return None
    measured = sum(s.verify_s + s.draft_s for s in steps)
    at_gamma0 = sum(s.emitted / s.rows * model.verify_s(s.rows, 1, s.context_len) for s in steps)
    predicted_wall = wall_s - measured + at_gamma0
    return generated / predicted_wall if predicted_wall > 0 else None
