"""Cost model of one speculative step, fitted from measured steps (no machine constants).

verify_s(rows, q, ctx): a target forward over rows x q tokens against ctx cached tokens. On an
accelerator it is flat while memory-bound (weights are read once whatever the batch) and rises
once compute-bound; so it is a hinge in N = rows * q (knee by grid search over the measured N),
plus a fixed extra cost m of a multi-token verify over one-token decoding, plus attention,
plus what each row costs whatever its q (r: per-row work; s: its KV cache, read once per step):

    verify_s = a + m * [q > 1] + b * N + h * max(0, N - knee) + c * N * ctx
               + r * rows + s * rows * ctx                                        (all >= 0)

Without the per-row terms a one-token step at 48 rows was priced 26% under its measured cost
and a 4-token one right, so speculation at large batch looked a third dearer than it was
(docs/decisions.md, 2026-12-03). They are fitted only where the records hold more than one q
(else rows and N are one column).

draft_s(rows, gamma, ctx): the heads' drafting (a step's draft time less its lookups, below):
every head's fill over the last step's verify (F tokens: its rows x its width, which a step
at a steady gamma makes rows * (gamma + 1)), attending to the context like the target, plus
gamma - 1 one-token steps:

    draft_s = [gamma > 0] * (d + e * F + k * F * ctx) + max(gamma - 1, 0) * (f + g * rows)

The fit reads F as each step recorded it (StepRecord.fill_tokens): after a plain step it is
rows, after n-gram drafts 8 wide it is rows * 9. Read as rows * (gamma + 1), such steps made the
fill's cost look like a depth's: after the draft-sources cells one fit priced a heads' depth at
48 rows at 10.8 ms, where a fit of heads-only steps gave 2.9 (docs/decisions.md, stop 37).

lookup_s(rows) = l * rows: host-side drafting (the n-gram lookup, which the source times itself,
and the per-row choice it needs: StepRecord.lookup_s, part of draft_s), the median per row of
the steps that looked up (else of the profile, which times the lookup alone).
So a step whose rows drafted from several sources is priced part by part: its verify by the
tokens it computed (N above), the heads by their depth, the lookup by its rows.

overhead_s(rows) = o0 + o1 * rows: the rest of a step (choosing gamma, emitting tokens, stop
checks), measured on real steps only and paid once per step however many tokens it emits.

Fits minimise relative error under non-negativity. The start-up profile (bare forwards, every
shape) is fitted together with the real steps (everything around the forwards, only the shapes
chosen), the profile weighted `profile_weight`; each part is then rescaled by the median of
real / predicted: the profile gives the shape of the costs, the real steps their level.

A smooth model is off by tens of percent at some shapes, so `LocalCorrection` multiplies it by
the median measured / modelled whole-step time of the last `KEEP_LOCAL` steps at each (gamma,
rows bucket, context bucket) with at least `MIN_LOCAL` of them (steps where every row drafted
the heads' gamma or none: a step with n-gram rows is no gamma's shape, and joins only the fit);
a shape not yet run borrows the factor of the nearest measured bucket at the same rows (same
gamma at the nearest context first, else the nearest gamma). These are kept per shape, apart
from the fit window, so a shape measured once stays measured. Prices age on a shared machine:
each bucket counts the policy's steps since it last ran (`age`, used by the policy to re-measure;
steps at a caller's fixed gamma price their bucket but do not age the others, so an engine that
alternates fixed and auto calls does not re-measure more of the auto calls' steps than the
policy's budget allows), and a bucket run again after REVISIT_STEPS steps elsewhere keeps only its newest
MIN_LOCAL - 1 old steps, so MIN_LOCAL new steps set its price. Measurements behind this design:
docs/decisions.md (2026-11-29). `VerifyCorrection` does the same for the verify alone, keyed
by tokens per row instead of gamma: it prices a padded verify of per-row (n-gram) drafts.
The first COLD_STEPS steps after a prefill of every active row (`cold`) price no bucket: they
pay for the caches the prefill left, whatever their gamma (on this CPU at one row the first
three took 35%, 15% and 8% longer than later ones, at gamma 0 and 2 alike). Such a step runs at
a row's first context bucket with whichever gamma the policy picked there, so that gamma was
priced at a cold step's cost (docs/decisions.md, stop 59).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field, fields, replace

import torch

CTX_SPAN = 1.5          # contexts must differ by this factor before a cost's slope along context is fitted
MIN_LOCAL = 4           # real steps at a (gamma, rows, context) bucket before they correct the model there
KEEP_LOCAL = 16         # the most recent steps per bucket that do
REVISIT_STEPS = 32      # a bucket run again after this many steps elsewhere: its old steps give way (below)
COLD_STEPS = 2          # steps after a prefill of the whole batch that price no bucket (below)


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


def _verify_features(n: torch.Tensor, multi: torch.Tensor, ctx: torch.Tensor, knee: float,
                     rows: torch.Tensor) -> torch.Tensor:
    """Columns for a, m, b, h, c, r, s (`rows` zero: the per-row terms left out)."""
    return torch.stack([torch.ones_like(n), multi, n, (n - knee).clamp(min=0), n * ctx, rows, rows * ctx], dim=1)


@dataclass(frozen=True)
class CostModel:
    verify_coef: tuple[float, float, float, float]     # a, b, h, c
    knee: float
    draft_coef: tuple[float, float, float, float]      # d, e, f, g
    samples: int
    multi_token_s: float = 0.0                         # m
    draft_ctx_s: float = 0.0                           # k
    overhead_coef: tuple[float, float] = (0.0, 0.0)    # o0, o1: per step, per row in the step
    lookup_row_s: float = 0.0                          # l: host-side drafting per row (n-gram lookup, choice)
    row_coef: tuple[float, float] = (0.0, 0.0)         # r, s: per row, per row x context, whatever q
    local: "LocalCorrection | None" = field(default=None, compare=False)   # measured / modelled per shape
    verify_local: "VerifyCorrection | None" = field(default=None, compare=False)   # the same, verify alone

    def to_dict(self) -> dict:
        """The smooth model as plain JSON values (tuples as lists). The local corrections are
        left out: they are the engine's measured state, not part of the model's formula."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
                for f in fields(self) if f.name not in _MEASURED}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        """The inverse of `to_dict` (lists back to tuples); keys it lacks keep their defaults."""
        return cls(**{f.name: tuple(d[f.name]) if isinstance(d[f.name], list) else d[f.name]
                      for f in fields(cls) if f.name not in _MEASURED and f.name in d})

    def verify_s(self, rows: int, q: int, ctx: float) -> float:
        a, b, h, c = self.verify_coef
        r, s = self.row_coef
        n = rows * q
        return (a + self.multi_token_s * (q > 1) + b * n + h * max(0.0, n - self.knee) + c * n * ctx
                + (r + s * ctx) * rows)

    def measured_verify_s(self, rows: int, q: int, ctx: float) -> float:
        """`verify_s` with the correction measured at this verify shape (VerifyCorrection), if any."""
        factor = self.verify_local.factor(q, rows, ctx) if self.verify_local is not None else 1.0
        return self.verify_s(rows, q, ctx) * factor

    def draft_s(self, rows: int, gamma: int, ctx: float = 0.0, fill: float | None = None) -> float:
        """The heads' drafting; `fill`: the tokens their fill runs (default rows * (gamma + 1))."""
        if gamma <= 0:
            return 0.0
        d, e, f, g = self.draft_coef
        fill = rows * (gamma + 1) if fill is None else fill
        return d + (e + self.draft_ctx_s * ctx) * fill + (gamma - 1) * (f + g * rows)

    def fill_s(self, tokens: float, ctx: float) -> float:
        """The heads' fill of `tokens` more (or fewer) tokens than a step's own: draft_s's F terms."""
        return (self.draft_coef[1] + self.draft_ctx_s * ctx) * tokens

    def lookup_s(self, rows: int) -> float:
        """Host-side drafting for `rows` rows (not in compute_s: it is paid whatever the gamma)."""
        return self.lookup_row_s * rows

    def overhead_s(self, rows: int) -> float:
        return self.overhead_coef[0] + self.overhead_coef[1] * rows

    def compute_s(self, rows: int, gamma: int, ctx: float) -> float:
        """Draft + verify: what StepRecord.draft_s + verify_s measure."""
        return self.verify_s(rows, gamma + 1, ctx) + self.draft_s(rows, gamma, ctx)

    def modelled_step_s(self, rows: int, gamma: int, ctx: float) -> float:
        """The whole step from the smooth model alone: draft + verify + overhead."""
        return self.compute_s(rows, gamma, ctx) + self.overhead_s(rows)

    def step_s(self, rows: int, gamma: int, ctx: float) -> float:
        """The whole step, with the local correction measured at this shape (if any)."""
        return self.modelled_step_s(rows, gamma, ctx) * self.local_factor(rows, gamma, ctx)

    def local_factor(self, rows: int, gamma: int, ctx: float) -> float:
        return self.local.factor(gamma, rows, ctx) if self.local is not None else 1.0

    def step_s_by_gamma(self, rows: int, gamma_max: int, ctx: float) -> list[float]:
        """`step_s` for gamma 0..gamma_max (the shape's buckets worked out once)."""
        factors = (self.local.factors_by_gamma(rows, ctx, gamma_max) if self.local is not None
                   else [1.0] * (gamma_max + 1))
        return [self.modelled_step_s(rows, g, ctx) * f for g, f in enumerate(factors)]


def rows_bucket(rows: int) -> int:
    """Half-octave buckets: 1 | 2 | 3 | 4 | 5-6 | 7-9 | 10-13 | 14-19 | 20-27 | 28-38 | 39-54 ..."""
    return round(2 * math.log2(max(rows, 1)))


def context_bucket(ctx: float) -> int:
    """Octaves of mean context: ... 32-63 | 64-127 | 128-255 | 256-511 ..."""
    return int(math.log2(max(ctx, 1.0)))


def step_seconds(step) -> float:
    """A StepRecord's whole measured time: draft + verify + the overhead around them."""
    return step.verify_s + step.draft_s + getattr(step, "overhead_s", 0.0)


def cold(step) -> bool:
    """Whether a StepRecord ran within COLD_STEPS steps of a prefill of every active row
    (StepRecord.after_prefill)."""
    return 0 <= getattr(step, "after_prefill", -1) < COLD_STEPS


def heads_fill(step) -> float:
    """The tokens a StepRecord's heads' fill ran (rows * (gamma + 1) where it did not record them)."""
    fill = getattr(step, "fill_tokens", -1)
    return float(step.rows * (step.gamma + 1) if fill < 0 else fill)


def extra_fill(step) -> float:
    """The tokens a step's heads' fill ran beyond its own gamma's (0 for a plain step)."""
    return heads_fill(step) - step.rows * (step.gamma + 1) if step.gamma > 0 else 0.0


def heads_draft_s(step) -> float:
    """A StepRecord's drafting less its host-side lookups: what draft_s(rows, gamma, ctx, fill) prices."""
    return step.draft_s - getattr(step, "lookup_s", 0.0)


class LocalCorrection:
    """Measured / modelled whole-step time per (gamma, rows bucket, context bucket), from the
    steps the engine ran. `add` records a step (O(1)); `rebase` re-prices every kept step after
    the smooth model is refitted. `factor` is the median ratio of the bucket with at least
    MIN_LOCAL steps, else of the nearest measured bucket at the same rows (module docstring),
    else 1 (the model as it is)."""

    def __init__(self, keep: int = KEEP_LOCAL):
        self.keep = keep
        self.samples: dict[tuple, deque] = {}       # key -> (rows, ctx, seconds, extra fill) of its last steps
        self.ratios: dict[tuple, deque] = {}        # key -> measured / modelled of the same steps
        self.factors: dict[tuple, float] = {}       # key -> median ratio, keys with >= MIN_LOCAL
        self.clock = 0                              # policy steps added (`tick`), all buckets
        self.next_remeasure = 0.0                   # clock before which no policy starts a re-measure
        self.last: dict[tuple, int] = {}            # key -> clock at its newest step
        self.visit: dict[tuple, int] = {}           # key -> steps since it was last revisited (or first run)
        self._by_rows: dict[int, list] = {}         # rows bucket -> measured (gamma, context bucket)
        self._source: dict[tuple, tuple | None] = {}    # key -> the measured key it takes (memo)

    @staticmethod
    def key(gamma: int, rows: int, ctx: float) -> tuple:
        return (gamma, rows_bucket(rows), context_bucket(ctx))

    def step_key(self, step) -> tuple:
        return self.key(step.gamma, step.rows, step.context_len)

    @staticmethod
    def seconds(step) -> float:
        """What a step measured of the priced quantity: here the whole step, less the work any
        gamma pays (StepRecord.shared_s: choosing the gamma, releasing finished rows). That work
        falls mostly on an auto call's plain steps (rows' last steps, measuring steps), and with
        it plain decoding was priced at 2.3x its cost (docs/decisions.md, stop 55)."""
        return step_seconds(step) - getattr(step, "shared_s", 0.0)

    @staticmethod
    def modelled(model: CostModel, k: int, rows: int, ctx: float) -> float:
        """The smooth model's price of the same quantity at the bucket's k (here gamma)."""
        return model.modelled_step_s(rows, k, ctx)

    @staticmethod
    def extra(step) -> float:
        """Tokens the step's heads filled beyond its gamma's (extra_fill), priced into `priced`:
        a step after a wider one measures its bucket, not the wider step's fill."""
        return extra_fill(step)

    def priced(self, model: CostModel, k: int, rows: int, ctx: float, extra: float) -> float:
        """What `model` prices a step of the bucket's k at, plus the heads' fill of `extra` tokens."""
        return self.modelled(model, k, rows, ctx) + model.fill_s(extra, ctx)

    def count(self, gamma: int, rows: int, ctx: float) -> int:
        """Steps kept at this bucket."""
        return len(self.samples.get(self.key(gamma, rows, ctx), ()))

    def age(self, gamma: int, rows: int, ctx: float) -> int | None:
        """Steps the engine ran elsewhere since this bucket's newest step; None if never run."""
        last = self.last.get(self.key(gamma, rows, ctx))
        return None if last is None else self.clock - last

    def nearby_age(self, gamma: int, rows: int, ctx: float) -> int | None:
        """For a bucket with no steps of its own: the age of the newest priced bucket (MIN_LOCAL
        steps) of the same gamma and rows one context octave away, whose factor it borrows (a
        row's context grows into the next octave as it decodes); None if there is none."""
        g, rb, cb = self.key(gamma, rows, ctx)
        ages = [self.clock - self.last[k] for k in ((g, rb, cb - 1), (g, rb, cb + 1)) if k in self.factors]
        return min(ages, default=None)

    def visit_steps(self, gamma: int, rows: int, ctx: float) -> int:
        """Steps at this bucket since it was last revisited after REVISIT_STEPS elsewhere."""
        return self.visit.get(self.key(gamma, rows, ctx), 0)

    def add(self, step, model: CostModel | None = None, key: tuple | None = None, tick: bool = True) -> None:
        """Record a step; with `model` (the smooth model this correction belongs to) price it now.
        `key`: the step's `key(...)`, where the caller has it already. `tick`: the policy chose
        it, so it ages every other bucket (module docstring)."""
        key = key or self.step_key(step)
        sample = (step.rows, step.context_len, self.seconds(step), self.extra(step))
        kept = self.samples.setdefault(key, deque(maxlen=self.keep))
        if key in self.last and self.clock - self.last[key] > REVISIT_STEPS:
            for old in (kept, self.ratios.get(key)):     # revisited: the old steps give way to new ones
                while old and len(old) > MIN_LOCAL - 1:
                    old.popleft()
            self.visit[key] = 0
        kept.append(sample)
        self.clock += tick
        self.last[key] = self.clock
        self.visit[key] = self.visit.get(key, 0) + 1
        if model is not None:
            self._price(key, model, [sample])

    def rebase(self, model: CostModel) -> None:
        """Re-price every kept step against `model` (after a refit)."""
        self.ratios, self.factors, self._by_rows, self._source = {}, {}, {}, {}
        for key, samples in self.samples.items():
            self._price(key, model, samples)

    def _price(self, key: tuple, model: CostModel, samples) -> None:
        ratios = self.ratios.setdefault(key, deque(maxlen=self.keep))
        for rows, ctx, seconds, extra in samples:
            modelled = self.priced(model, key[0], rows, ctx, extra)
            if modelled > 0:
                ratios.append(seconds / modelled)
        if len(ratios) >= MIN_LOCAL:
            if key not in self.factors:
                self._by_rows.setdefault(key[1], []).append((key[0], key[2]))
                self._source = {}                   # a newly measured bucket: resolve again
            self.factors[key] = statistics.median(ratios)

    def factor(self, gamma: int, rows: int, ctx: float) -> float:
        return self._factor_at(gamma, rows_bucket(rows), context_bucket(ctx))

    def factors_by_gamma(self, rows: int, ctx: float, gamma_max: int) -> list[float]:
        """`factor` for gamma 0..gamma_max at one shape."""
        rb, cb = rows_bucket(rows), context_bucket(ctx)
        return [self._factor_at(g, rb, cb) for g in range(gamma_max + 1)]

    def priced_by_own(self, gamma: int, rows: int, ctx: float) -> bool:
        """Whether `factor` at this shape comes from this gamma's own steps at these rows (at this
        context bucket or the nearest measured one), not from another gamma's."""
        return self.own_age(gamma, rows, ctx) is not None

    def own_age(self, gamma: int, rows: int, ctx: float) -> int | None:
        """Steps the engine ran elsewhere since the newest step of the bucket whose own steps
        price this gamma at this shape (`priced_by_own`: this context bucket or the nearest
        measured one); None where another gamma's steps price it, or none do."""
        source = self._source_at(gamma, rows_bucket(rows), context_bucket(ctx))
        return None if source is None or source[0] != gamma else self.clock - self.last[source]

    def _factor_at(self, gamma: int, rb: int, cb: int) -> float:
        source = self._source_at(gamma, rb, cb)
        return self.factors[source] if source is not None else 1.0

    def _source_at(self, gamma: int, rb: int, cb: int) -> tuple | None:
        """The measured bucket whose factor prices (gamma, rb, cb): the same gamma at the nearest
        context, else the nearest gamma, at these rows; None where none is (memoised)."""
        key = (gamma, rb, cb)
        if key not in self._source:
            measured = self._by_rows.get(rb, [])
            g, c = min(measured, key=lambda m: (m[0] != gamma, abs(m[0] - gamma), abs(m[1] - cb), -m[0]),
                       default=(None, None))
            self._source[key] = None if g is None else (g, rb, c)
        return self._source[key]


class VerifyCorrection(LocalCorrection):
    """Measured / modelled verify time per (tokens per row q, rows bucket, context bucket), from
    every step whose verify computed the same q for every row (plain, the heads' gamma, a padded
    verify of n-gram drafts), with LocalCorrection's rules (MIN_LOCAL steps; an unmeasured q
    borrows the nearest measured q at the same rows). It prices the width of a padded verify of
    per-row drafts, which is no gamma's step: the smooth fit priced a 3-token verify at 48 rows
    23% under its measured cost, and the n-gram drafts it let through lost 8% of throughput
    (docs/decisions.md, 2026-12-03)."""

    def step_key(self, step) -> tuple:
        return self.key(int(step.query_len), step.rows, step.context_len)

    @staticmethod
    def seconds(step) -> float:
        return step.verify_s

    @staticmethod
    def modelled(model: CostModel, k: int, rows: int, ctx: float) -> float:
        return model.verify_s(rows, k, ctx)

    @staticmethod
    def extra(step) -> float:
        return 0.0                         # the verify alone: the heads' fill is not in it

    @staticmethod
    def takes(step) -> bool:
        """A verify of q tokens on every row (a packed or split step's mean q is no one shape)."""
        return step.verify_s > 0 and step.query_len == int(step.query_len)


_MEASURED = ("local", "verify_local")    # CostModel fields that hold measured state, not the formula


def _thin(values: list[float], most: int) -> list[float]:
    if len(values) <= most:
        return values
    picks = torch.linspace(0, len(values) - 1, most).round().long().tolist()
    return [values[i] for i in sorted(set(picks))]


def _fit_verify(n, multi, ctx, y, weight, knee, rows):
    x = _verify_features(n, multi, ctx, knee, rows)
    coef = nnls(x, y, weight)
    return float((((x @ coef) - y) ** 2 * weight).sum()), knee, coef


def best_knee_fit(n, multi, ctx, y, weight, rows, most: int = 8):
    """Grid search for the hinge over the distinct measured N: a coarse pass over `most`
    quantiles, then a fine pass between the best one's neighbours (2 x `most` fits at most).
    `rows`: each record's rows, for the per-row terms (zeros: left out)."""
    values = sorted(set(n.tolist()))
    coarse = _thin(values, most)
    fits = [_fit_verify(n, multi, ctx, y, weight, k, rows) for k in coarse]
    i = min(range(len(fits)), key=lambda j: fits[j][0])
    lo, hi = coarse[max(i - 1, 0)], coarse[min(i + 1, len(coarse) - 1)]
    fine = [v for v in _thin([v for v in values if lo <= v <= hi], most) if v not in coarse]
    fits += [_fit_verify(n, multi, ctx, y, weight, k, rows) for k in fine]
    return min(fits, key=lambda f: f[0])


def fit_cost_model(steps, profile=(), profile_weight: float = 0.25, local: LocalCorrection | None = None,
                   verify_local: VerifyCorrection | None = None) -> CostModel | None:
    """Fit from StepRecord-like objects (rows, query_len, context_len, verify_s, draft_s, gamma;
    lookup_s where they have it):
    `steps` the engine ran, `profile` timed bare forwards (weighted `profile_weight`).
    `local`, `verify_local`: the steps measured per shape (the engine keeps them across fits;
    rebased onto the new model here); default: corrections built from `steps`.
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
    qs = {s.query_len for s, _ in records}
    rows = torch.tensor([float(s.rows) if len(qs) > 1 else 0.0 for s, _ in records], **f64)
    _, knee, vcoef = best_knee_fit(n, multi, ctx, y, w / y.clamp(min=1e-6) ** 2, rows)
    drafted = [(s, wt) for s, wt in records if s.gamma > 0 and heads_draft_s(s) > 0]
    dcoef = torch.zeros(5, **f64)
    if drafted:
        xd = torch.tensor([[1.0, heads_fill(s), s.gamma - 1, (s.gamma - 1) * s.rows,
                            heads_fill(s) * s.context_len] for s, _ in drafted], **f64)
        yd = torch.tensor([heads_draft_s(s) for s, _ in drafted], **f64)
        wd = torch.tensor([wt for _, wt in drafted], **f64)
        if not _spans([s.context_len for s, _ in drafted]):
            xd[:, 4] = 0.0                 # one context: its slope is not identified (NNLS would guess it)
        dcoef = nnls(xd, yd, wd / yd.clamp(min=1e-6) ** 2)
    a, m, b, h, c, r, rs = vcoef.tolist()
    *dcoef, k = dcoef.tolist()
    model = CostModel((a, b, h, c), knee, tuple(dcoef), len(records), multi_token_s=m, draft_ctx_s=k,
                      row_coef=(r, rs),
                      overhead_coef=_fit_overhead([s for s in steps if getattr(s, "overhead_s", 0.0) > 0]),
                      lookup_row_s=_fit_lookup(steps) or _fit_lookup(profile))
    real = [s for s in steps if s.verify_s > 0]
    model = rescale_to(model, real)
    if local is None:
        local = LocalCorrection()
        for s in real:
            local.add(s)
    if verify_local is None:
        verify_local = VerifyCorrection()
        for s in real:
            if verify_local.takes(s):
                verify_local.add(s)
    local.rebase(model)
    verify_local.rebase(model)
    return replace(model, local=local, verify_local=verify_local)


def _spans(values, ratio: float = CTX_SPAN) -> bool:
    """Whether `values` (contexts) differ by `ratio` x or more: enough to fit a slope along them.
    Example: a fresh call's first drafted steps all at ~150 tokens of context do not, and a fit
    free to use the context column priced a depth as all context: half its cost at 60 tokens."""
    lo, hi = min(values, default=0.0), max(values, default=0.0)
    return lo > 0 and hi >= ratio * lo


def _fit_overhead(steps) -> tuple[float, float]:
    """o0 + o1 * rows from the real steps' measured overhead (relative error, o >= 0)."""
    if not steps:
        return (0.0, 0.0)
    f64 = dict(dtype=torch.float64)
    x = torch.tensor([[1.0, float(s.rows)] for s in steps], **f64)
    y = torch.tensor([s.overhead_s for s in steps], **f64)
    o0, o1 = nnls(x, y, 1 / y.clamp(min=1e-7) ** 2).tolist()
    return (o0, o1)


def _fit_lookup(steps) -> float:
    """l: the median host-side lookup seconds per row over the steps that looked up (0: none did)."""
    per_row = [s.lookup_s / s.rows for s in steps if getattr(s, "lookup_s", 0.0) > 0 and s.rows > 0]
    return statistics.median(per_row) if per_row else 0.0


def rescale_to(model: CostModel, real) -> CostModel:
    """`model` with its verify and draft parts scaled so that, over the real steps, the median
    of measured / predicted is 1."""
    if not real:
        return model
    v = statistics.median(s.verify_s / max(model.verify_s(s.rows, s.query_len, s.context_len), 1e-12) for s in real)
    drafted = [s for s in real if s.gamma > 0 and heads_draft_s(s) > 0]
    d = statistics.median(heads_draft_s(s) / max(model.draft_s(s.rows, s.gamma, s.context_len, heads_fill(s)), 1e-12)
                          for s in drafted) if drafted else 1.0
    return replace(model, verify_coef=tuple(x * v for x in model.verify_coef),
                   draft_coef=tuple(x * d for x in model.draft_coef), multi_token_s=model.multi_token_s * v,
                   row_coef=tuple(x * v for x in model.row_coef),
                   draft_ctx_s=model.draft_ctx_s * d)
