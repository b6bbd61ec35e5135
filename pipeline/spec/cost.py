"""Cost model of one speculative step, fitted from measured steps (no machine constants).

verify_s(rows, q, ctx): a target forward over rows x q tokens against ctx cached tokens. On an
accelerator it is flat while memory-bound (weights are read once whatever the batch) and rises
once compute-bound; so it is fitted as a hinge in N = rows * q plus an attention term:

    verify_s = a + m * [q > 1] + b * N + h * max(0, N - knee) + c * N * ctx     (all >= 0)

m is the fixed extra cost of a multi-token verify over one-token decoding (other kernels,
masks, a wider logits slice); measured on a CPU it is a large part of a small model's step.
The knee is chosen by grid search over the measured N. draft_s(rows, gamma): the MTP fill over
the tokens accepted last step (about rows * (gamma + 1) of them) plus gamma - 1 one-token head
steps:

    draft_s = [gamma > 0] * (d + e * rows * (gamma + 1)) + max(gamma - 1, 0) * (f + g * rows)

A step also spends time outside both forwards: choosing gamma, emitting tokens, stop checks.
It is measured on every real step (the profile has none) and fitted as o0 + o1 * rows; it is
why a small model's plain decoding step costs more than its forward alone, and it is paid once
per step however many tokens the step emits.

A smooth model of the whole range of shapes is off by tens of percent at some of them (a CPU's
batch-1 step is mostly interpreter time the hinge does not see). So the steps the engine really
ran also correct it locally: for each (gamma, rows bucket, half an octave wide) with at least
`MIN_LOCAL` recent steps, the median of measured / modelled whole-step time multiplies the
model there; a gamma not yet run at those rows takes the nearest measured gamma's factor. What
the engine runs is thus priced as measured, and a gamma it has not run is priced by the model
until it runs it.

Fits minimise relative error (times span orders of magnitude) under non-negativity. The
start-up profile times bare forwards and covers every shape; the steps the engine really ran
include everything around them but only the shapes it chose. So both are fitted (the profile
weighted `profile_weight`), and then each part is rescaled by the median of real / predicted
over the real steps: the profile gives the shape of the costs, the real steps their level.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

import torch

MIN_LOCAL = 4           # real steps in a (gamma, rows bucket) before they correct the model there


def nnls(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Weighted least squares with coefficients >= 0 (active set: drop negatives, refit).

    Columns other than the first that are constant (collinear with the intercept: e.g. every
    sample a multi-token verify) get coefficient 0, and solves use the SVD (min-norm), so the
    answer is the same on every run even where columns are collinear (e.g. one context length)."""
    coef = torch.zeros(x.shape[1], dtype=torch.float64)
    active = [j for j in range(x.shape[1]) if j == 0 or not _constant(x[:, j])]
    w = weight.sqrt()[:, None]
    while active:
        sol = torch.linalg.lstsq(x[:, active] * w, y[:, None] * w, driver="gelsd").solution[:, 0]
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active = [a for a, s in zip(active, sol.tolist()) if s > 0]
    return coef


def _constant(col: torch.Tensor) -> bool:
    return bool((col - col[0]).abs().max() <= 1e-12 * max(1.0, float(col.abs().max())))


def _verify_features(n: torch.Tensor, multi: torch.Tensor, ctx: torch.Tensor, knee: float) -> torch.Tensor:
    """Columns for a, m, b, h, c."""
    return torch.stack([torch.ones_like(n), multi, n, (n - knee).clamp(min=0), n * ctx], dim=1)


@dataclass(frozen=True)
class CostModel:
    verify_coef: tuple[float, float, float, float]     # a, b, h, c
    knee: float
    draft_coef: tuple[float, float, float, float]      # d, e, f, g
    samples: int
    multi_token_s: float = 0.0                         # m
    overhead_coef: tuple[float, float] = (0.0, 0.0)    # o0, o1: per step, per row in the step
    local: dict = field(default_factory=dict, compare=False)   # {(gamma, rows_bucket): measured / modelled}

    def verify_s(self, rows: int, q: int, ctx: float) -> float:
        a, b, h, c = self.verify_coef
        n = rows * q
        return a + self.multi_token_s * (q > 1) + b * n + h * max(0.0, n - self.knee) + c * n * ctx

    def draft_s(self, rows: int, gamma: int, ctx: float = 0.0) -> float:
        if gamma <= 0:
            return 0.0
        d, e, f, g = self.draft_coef
        return d + e * rows * (gamma + 1) + (gamma - 1) * (f + g * rows)

    def overhead_s(self, rows: int) -> float:
        return self.overhead_coef[0] + self.overhead_coef[1] * rows

    def compute_s(self, rows: int, gamma: int, ctx: float) -> float:
        """Draft + verify: what StepRecord.draft_s + verify_s measure."""
        return self.verify_s(rows, gamma + 1, ctx) + self.draft_s(rows, gamma, ctx)

    def modelled_step_s(self, rows: int, gamma: int, ctx: float) -> float:
        """The whole step from the smooth model alone: draft + verify + overhead."""
        return self.compute_s(rows, gamma, ctx) + self.overhead_s(rows)

    def step_s(self, rows: int, gamma: int, ctx: float) -> float:
        """The whole step, with the local correction measured at these rows (if any)."""
        return self.modelled_step_s(rows, gamma, ctx) * self.local_factor(rows, gamma)

    def local_factor(self, rows: int, gamma: int) -> float:
        b = rows_bucket(rows)
        if (gamma, b) in self.local:
            return self.local[(gamma, b)]
        near = sorted((abs(g - gamma), -g) for g, bb in self.local if bb == b)
        return self.local[(-near[0][1], b)] if near else 1.0


def rows_bucket(rows: int) -> int:
    """Half-octave buckets: 1 | 2 | 3 | 4 | 5-6 | 7-9 | 10-13 | 14-19 | 20-27 | 28-38 | 39-54 ..."""
    return round(2 * math.log2(max(rows, 1)))


def local_corrections(model: CostModel, real) -> dict:
    """{(gamma, rows_bucket): median measured / modelled whole-step time} over `real` steps,
    for buckets with at least MIN_LOCAL of them."""
    groups: dict = {}
    for s in real:
        modelled = model.modelled_step_s(s.rows, s.gamma, s.context_len)
        if modelled > 0:
            groups.setdefault((s.gamma, rows_bucket(s.rows)), []).append(
                (s.verify_s + s.draft_s + getattr(s, "overhead_s", 0.0)) / modelled)
    return {k: statistics.median(v) for k, v in groups.items() if len(v) >= MIN_LOCAL}


def _thin(values: list[float], most: int) -> list[float]:
    if len(values) <= most:
        return values
    picks = torch.linspace(0, len(values) - 1, most).round().long().tolist()
    return [values[i] for i in sorted(set(picks))]


def _fit_verify(n, multi, ctx, y, weight, knee):
    x = _verify_features(n, multi, ctx, knee)
    coef = nnls(x, y, weight)
    return float((((x @ coef) - y) ** 2 * weight).sum()), knee, coef


def best_knee_fit(n, multi, ctx, y, weight, most: int = 8):
    """Grid search for the hinge over the distinct measured N: a coarse pass over `most`
    quantiles, then a fine pass between the best one's neighbours (2 x `most` fits at most)."""
    values = sorted(set(n.tolist()))
    coarse = _thin(values, most)
    fits = [_fit_verify(n, multi, ctx, y, weight, k) for k in coarse]
    i = min(range(len(fits)), key=lambda j: fits[j][0])
    lo, hi = coarse[max(i - 1, 0)], coarse[min(i + 1, len(coarse) - 1)]
    fine = [v for v in _thin([v for v in values if lo <= v <= hi], most) if v not in coarse]
    fits += [_fit_verify(n, multi, ctx, y, weight, k) for k in fine]
    return min(fits, key=lambda f: f[0])


def fit_cost_model(steps, profile=(), profile_weight: float = 0.25) -> CostModel | None:
    """Fit from StepRecord-like objects (rows, query_len, context_len, verify_s, draft_s, gamma):
    `steps` the engine ran, `profile` timed bare forwards (weighted `profile_weight`).
    Returns None with fewer than 3 distinct verify shapes (nothing to fit yet)."""
    records = [(s, 1.0) for s in steps if s.verify_s > 0] + [(s, profile_weight) for s in profile if s.verify_s > 0]
    if len({(s.rows, s.query_len) for s, _ in records}) < 3:
        return None
    f64 = dict(dtype=torch.float64)
    n = torch.tensor([float(s.rows * s.query_len) for s, _ in records], **f64)
    multi = torch.tensor([float(s.query_len > 1) for s, _ in records], **f64)
    ctx = torch.tensor([float(s.context_len) for s, _ in records], **f64)
    y = torch.tensor([s.verify_s for s, _ in records], **f64)
    w = torch.tensor([w for _, w in records], **f64)
    _, knee, vcoef = best_knee_fit(n, multi, ctx, y, w / y.clamp(min=1e-6) ** 2)
    drafted = [(s, wt) for s, wt in records if s.gamma > 0 and s.draft_s > 0]
    dcoef = torch.zeros(4, **f64)
    if drafted:
        xd = torch.tensor([[1.0, s.rows * (s.gamma + 1), s.gamma - 1, (s.gamma - 1) * s.rows] for s, _ in drafted], **f64)
        yd = torch.tensor([s.draft_s for s, _ in drafted], **f64)
        wd = torch.tensor([wt for _, wt in drafted], **f64)
        dcoef = nnls(xd, yd, wd / yd.clamp(min=1e-6) ** 2)
    a, m, b, h, c = vcoef.tolist()
    model = CostModel((a, b, h, c), knee, tuple(dcoef.tolist()), len(records), multi_token_s=m,
                      overhead_coef=_fit_overhead([s for s in steps if getattr(s, "overhead_s", 0.0) > 0]))
    real = [s for s in steps if s.verify_s > 0]
    model = rescale_to(model, real)
    return replace(model, local=local_corrections(model, real))


def _fit_overhead(steps) -> tuple[float, float]:
    """o0 + o1 * rows from the real steps' measured overhead (relative error, o >= 0)."""
    if not steps:
        return (0.0, 0.0)
    f64 = dict(dtype=torch.float64)
    x = torch.tensor([[1.0, float(s.rows)] for s in steps], **f64)
    y = torch.tensor([s.overhead_s for s in steps], **f64)
    o0, o1 = nnls(x, y, 1 / y.clamp(min=1e-7) ** 2).tolist()
    return (o0, o1)


def rescale_to(model: CostModel, real) -> CostModel:
    """`model` with its verify and draft parts scaled so that, over the real steps, the median
    of measured / predicted is 1."""
    if not real:
        return model
    v = statistics.median(s.verify_s / max(model.verify_s(s.rows, s.query_len, s.context_len), 1e-12) for s in real)
    drafted = [s for s in real if s.gamma > 0 and s.draft_s > 0]
    d = statistics.median(s.draft_s / max(model.draft_s(s.rows, s.gamma), 1e-12) for s in drafted) if drafted else 1.0
    return replace(model, verify_coef=tuple(x * v for x in model.verify_coef),
                   draft_coef=tuple(x * d for x in model.draft_coef), multi_token_s=model.multi_token_s * v)
