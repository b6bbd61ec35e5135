"""Cost model of one speculative step, fitted from measured steps (no machine constants).

verify_s(rows, q, ctx): a target forward over rows x q tokens against ctx cached tokens. On an
accelerator it is flat while memory-bound (weights are read once whatever the batch) and rises
once compute-bound; so it is fitted as a hinge in N = rows * q plus an attention term:

    verify_s = a + b * N + h * max(0, N - knee) + c * N * ctx        (a, b, h, c >= 0)

The knee is chosen by grid search over the measured N. draft_s(rows, gamma): the MTP fill over
the tokens accepted last step (about rows * (gamma + 1) of them) plus gamma - 1 one-token head
steps:

    draft_s = [gamma > 0] * (d + e * rows * (gamma + 1)) + max(gamma - 1, 0) * (f + g * rows)

Fits minimise relative error (times span orders of magnitude) under non-negativity.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def nnls(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Weighted least squares with coefficients >= 0 (active set: drop negatives, refit)."""
    active = list(range(x.shape[1]))
    coef = torch.zeros(x.shape[1], dtype=torch.float64)
    w = weight.sqrt()[:, None]
    while active:
        sol = torch.linalg.lstsq(x[:, active] * w, y[:, None] * w).solution[:, 0]
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active = [a for a, s in zip(active, sol.tolist()) if s > 0]
    return coef


def _verify_features(n: torch.Tensor, ctx: torch.Tensor, knee: float) -> torch.Tensor:
    return torch.stack([torch.ones_like(n), n, (n - knee).clamp(min=0), n * ctx], dim=1)


@dataclass(frozen=True)
class CostModel:
    verify_coef: tuple[float, float, float, float]     # a, b, h, c
    knee: float
    draft_coef: tuple[float, float, float, float]      # d, e, f, g
    samples: int

    def verify_s(self, rows: int, q: int, ctx: float) -> float:
        a, b, h, c = self.verify_coef
        n = rows * q
        return a + b * n + h * max(0.0, n - self.knee) + c * n * ctx

    def draft_s(self, rows: int, gamma: int, ctx: float = 0.0) -> float:
        if gamma <= 0:
            return 0.0
        d, e, f, g = self.draft_coef
        return d + e * rows * (gamma + 1) + (gamma - 1) * (f + g * rows)

    def step_s(self, rows: int, gamma: int, ctx: float) -> float:
        return self.verify_s(rows, gamma + 1, ctx) + self.draft_s(rows, gamma, ctx)


def _thin(values: list[float], most: int) -> list[float]:
    if len(values) <= most:
        return values
    picks = torch.linspace(0, len(values) - 1, most).round().long().tolist()
    return [values[i] for i in sorted(set(picks))]


def _fit_verify(n, ctx, y, weight, knee):
    x = _verify_features(n, ctx, knee)
    coef = nnls(x, y, weight)
    return float((((x @ coef) - y) ** 2 * weight).sum()), knee, coef


def best_knee_fit(n, ctx, y, weight, most: int = 8):
    """Grid search for the hinge over the distinct measured N: a coarse pass over `most`
    quantiles, then a fine pass between the best one's neighbours (2 x `most` fits at most)."""
    values = sorted(set(n.tolist()))
    coarse = _thin(values, most)
    fits = [_fit_verify(n, ctx, y, weight, k) for k in coarse]
    i = min(range(len(fits)), key=lambda j: fits[j][0])
    lo, hi = coarse[max(i - 1, 0)], coarse[min(i + 1, len(coarse) - 1)]
    fine = [v for v in _thin([v for v in values if lo <= v <= hi], most) if v not in coarse]
    fits += [_fit_verify(n, ctx, y, weight, k) for k in fine]
    return min(fits, key=lambda f: f[0])


def fit_cost_model(steps) -> CostModel | None:
    """Fit from StepRecord-like objects (rows, query_len, context_len, verify_s, draft_s, gamma).
    Returns None with fewer than 3 distinct verify shapes (nothing to fit yet)."""
    steps = [s for s in steps if s.verify_s > 0]
    if len({(s.rows, s.query_len) for s in steps}) < 3:
        return None
    n = torch.tensor([float(s.rows * s.query_len) for s in steps], dtype=torch.float64)
    ctx = torch.tensor([float(s.context_len) for s in steps], dtype=torch.float64)
    y = torch.tensor([s.verify_s for s in steps], dtype=torch.float64)
    weight = 1.0 / y.clamp(min=1e-6) ** 2
    best = best_knee_fit(n, ctx, y, weight)
    _, knee, vcoef = best
    drafted = [s for s in steps if s.gamma > 0 and s.draft_s > 0]
    dcoef = torch.zeros(4, dtype=torch.float64)
    if drafted:
        xd = torch.tensor([[1.0, s.rows * (s.gamma + 1), s.gamma - 1, (s.gamma - 1) * s.rows] for s in drafted],
                          dtype=torch.float64)
        yd = torch.tensor([s.draft_s for s in drafted], dtype=torch.float64)
        dcoef = nnls(xd, yd, 1.0 / yd.clamp(min=1e-6) ** 2)
    return CostModel(tuple(vcoef.tolist()), knee, tuple(dcoef.tolist()), len(steps))
