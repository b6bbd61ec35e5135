"""Choosing gamma, the number of drafts per verify step, for throughput.

    E(gamma)       = 1 + sum_{j=1..gamma} prod_{k<=j} a_k            (tokens per row per step)
    goodput(gamma) = rows * E(gamma) / (T_verify(rows, gamma+1, ctx) + T_draft(rows, gamma) + T_overhead(rows))

Some rows are priced on their own (`StepContext.rows_apart`), the rest at the task's E:
- a row that may take only r more tokens (its max_new_tokens budget) gains nothing from drafts
  beyond r - 1, so its E is taken at min(gamma, r - 1);
- at a shard's tail (no rows queued, at most `FEW_ROWS` active), each row's own first-draft hit
  rate scales the task's a_k for it (Beta prior of weight `ROW_PRIOR` at the task's a_1). A
  fresh row is a typical one, priced at the task's E; the few rows left at the end are the ones
  that ran longest, and on the demo model they accept far less than the task's average.

`GoodputPolicy` picks the gamma in 0..gamma_max with the highest predicted goodput, from
per-depth acceptance a_k (this task's earlier shards as a prior, plus what this run measured)
and a cost model fitted from measured steps. gamma = 0 is always a candidate: where the
accelerator is compute-bound, verifying gamma + 1 tokens costs about gamma + 1 times one, and
speculation loses. The engine asks before every step, so the choice follows the active batch
as it shrinks at a shard's tail (fewer rows leave more idle compute: for rows at the task's
acceptance gamma never drops). The one way it can drop is a row priced on its own: a tail row
whose own drafts keep missing, or one a token or two from its budget, is worth fewer drafts.

A task with too few observations is calibrated first: gamma_max for `calibration_rows` (256)
row-steps, since one step at gamma_max observes every depth at once. Once calibrated, a task
whose speculation does not pay runs gamma 0 and observes no more drafts, so the calibration
must be good enough to live on, and must cover enough rows: acceptance varies more between rows
than within one. Measured on the demo model at batch 1 (24 rows, gamma 5 over all of them as
the reference): 16 row-steps estimated json's a_1 at 0.53-0.64 (0.78), and 64 row-steps (about
three rows) estimated complete's a_3..a_5 at 0.91/0.94/0.99 (0.79/0.75/0.83), so the policy kept
gamma 0 for json where gamma 3-5 ran 9-16% faster and speculated for complete where gamma 5 ran
23% slower; 256 row-steps gave 0.81/0.74/0.88. That is about six steps at batch 48, or a dozen
rows at batch 1, once per task. Once per run, not per actor: the driver's plan
(pipeline.spec_decode.plan) hands each policy the run's evidence as its prior, and a policy told
not to calibrate (`calibrate=False`: another shard is calibrating the task) runs the plan's
gamma (`planned`) until its own evidence suffices.

Plain decoding is measured before speculation at every shape: where the engine's local
correction (pipeline.spec_decode.cost) holds fewer than MIN_LOCAL plain-decoding steps at this (rows,
context) bucket, a speculative choice runs gamma 0 instead until it does. Otherwise gamma 0
would be priced by a speculative gamma's correction, and on a CPU the two differ by tens of
percent; the price is at most MIN_LOCAL plain steps per bucket, once per engine.

Measurements age. On a shared machine a slow spell lasts seconds, and a gamma the policy stopped
running keeps the price it had then (pipeline.spec_decode.cost says what that did). So while the
policy speculates, plain decoding is run again at a (rows, context) shape for MIN_LOCAL steps
once the engine has run more than MIN_LOCAL * gap / `remeasure_share` steps (any shape) since
it last ran there, gap being how far behind gamma 0 is predicted (at least `min_gain`).
Re-measuring thus costs about `remeasure_share` (0.5%) of the steps' worth per shape the engine
moves between (at batch 1, rows of different prompt lengths alternate between two or three
context buckets), whatever the gap, and a gamma 0 mispriced by a spell is run again within
~800 * gap steps (about a second at batch 1 here for a 30% gap). Age counts the engine's steps,
not steps at the shape: a shape visited a few steps per row would otherwise stay mispriced for
most of a shard. These steps are marked `measuring`, as are the plain-decoding ones above.

The other way round is not done: at gamma 0, a speculative gamma priced high by a spell is not
run again to check (a new profile re-prices it). Tried, it cost more than it could win here:
every shape a batch-48 tail passes through had a speculative price thousands of steps old, and
re-measuring each made auto run 10-18% below gamma 0 in 2 of 7 batch-48 calls per task of the
benchmark, where gamma 0 is best. A gamma 0 left mispriced costs throughput below gamma 0; a
speculative gamma left mispriced only delays a gain.

Speculation must predict more than `min_gain` (default 5%) over plain decoding to be chosen:
predictions carry a few percent of error, and where speculation's predicted gain is within it,
plain decoding is the choice that cannot lose to gamma 0. Among speculative gammas the argmax
stands.

A decision is reused for up to `recheck_steps` (8) steps while the row count, the cost model,
the context bucket and the rows priced apart stay the same: acceptance estimates move slowly, and
deciding costs tens of microseconds, a percent of a small model's step on a CPU. A gamma-0
decision is reused for up to `recheck_plain_steps` (32): plain decoding drafts nothing, so no
acceptance estimate moves while it runs, and the cost model's refits change the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby
from typing import Callable, Protocol

from pipeline.spec_decode.cost import MIN_LOCAL, REVISIT_STEPS, CostModel, LocalCorrection
from pipeline.spec_decode.stats import SpecStats

FEW_ROWS = 8            # at a tail (none queued), at most this many rows: each priced with its own acceptance
ROW_PRIOR = 4.0         # weight (row-steps) of the task's a_1 in a row's own first-draft estimate


@dataclass(frozen=True)
class StepContext:
    rows: int               # active rows in the coming verify step
    context_len: float      # mean cached tokens per row
    stats: SpecStats        # what this generate call has measured so far
    rows_apart: tuple[tuple[int, int, int], ...] = ()   # (tokens left, steps drafted, first-draft hits)


class GammaPolicy(Protocol):
    def choose(self, ctx: StepContext) -> int: ...
    def max_gamma(self) -> int: ...


@dataclass(frozen=True)
class FixedGamma:
    gamma: int
    reason: str = "fixed by caller"

    def choose(self, ctx: StepContext) -> int:
        return self.gamma

    def max_gamma(self) -> int:
        return self.gamma


def expected_tokens(acceptance: list[float], gamma: int) -> float:
    """E(gamma) = 1 + sum_j prod_{k<=j} a_k. Example: a = [0.8, 0.5], gamma 2 -> 1 + 0.8 + 0.4 = 2.2."""
    total, run = 1.0, 1.0
    for a in acceptance[:gamma]:
        run *= a
        total += run
    return total


def estimate_acceptance(reached: list[int], accepted: list[int], depth: int,
                        prior_mean: float = 0.5, prior_weight: float = 4.0) -> list[float]:
    """Per-depth acceptance a_1..a_depth with a Beta prior. Depth k's prior mean is depth k-1's
    estimate (acceptance rarely rises with depth), depth 1's is `prior_mean`."""
    out, mean = [], prior_mean
    for k in range(depth):
        r = reached[k] if k < len(reached) else 0
        a = accepted[k] if k < len(accepted) else 0
        mean = (a + prior_weight * mean) / (r + prior_weight)
        out.append(mean)
    return out


@dataclass
class Decision:
    gamma: int
    reason: str
    candidates: list[int]
    predicted_goodput: list[float]      # tokens/s per candidate (empty while calibrating)
    acceptance: list[float]
    measuring: bool = False             # gamma 0 run to measure plain decoding at this shape
    calibrating: bool = False           # gamma_max run to measure acceptance at every depth


@dataclass
class GoodputPolicy:
    gamma_max: int
    cost: Callable[[], CostModel | None]        # current fitted cost model (refined online)
    prior: SpecStats = field(default_factory=SpecStats)   # earlier shards of this task
    calibration_rows: int = 256
    recheck_steps: int = 8
    recheck_plain_steps: int = 32       # a gamma-0 decision: no drafts, so no acceptance moves meanwhile
    min_gain: float = 0.05
    remeasure_share: float = 0.005      # what re-measuring gamma 0 while speculating may cost (share of steps x gap)
    planned: int | None = None          # the driver's plan (pipeline.spec_decode.plan): run while evidence is short
    calibrate: bool = True              # False: another shard calibrates this task; do not calibrate here
    decisions: list[Decision] = field(default_factory=list)
    _cached: tuple | None = field(default=None, repr=False)     # (key, decision, steps reused)

    def max_gamma(self) -> int:
        return self.gamma_max

    def choose(self, ctx: StepContext) -> int:
        model = self.cost()
        key = (ctx.rows, id(model), int(ctx.context_len) // 64, ctx.rows_apart)
        if (self._cached is not None and self._cached[0] == key
                and self._cached[2] < (self.recheck_steps if self._cached[1].gamma else self.recheck_plain_steps)):
            self._cached = (key, self._cached[1], self._cached[2] + 1)
            self.decisions.append(self._cached[1])
            return self._cached[1].gamma
        gamma = self._decide(ctx, model)
        d = self.decisions[-1]
        self._cached = (key, d, 1) if d.predicted_goodput and not d.measuring else None   # nor while measuring
        return gamma

    def _decide(self, ctx: StepContext, model: CostModel | None) -> int:
        reached, accepted = _add(self.prior.reached, ctx.stats.reached), _add(self.prior.accepted, ctx.stats.accepted)
        seen = reached[0] if reached else 0
        if self.gamma_max == 0:
            return self._record(Decision(0, "gamma_max is 0", [0], [], []))
        if seen < self.calibration_rows and not self.calibrate:
            g = min(self.planned or 0, self.gamma_max)
            return self._record(Decision(g, f"the plan's gamma {g}: too little evidence ({seen} row-steps) and "
                                            "calibration of this task is under way elsewhere", [], [], []))
        if seen < self.calibration_rows:
            return self._record(Decision(self.gamma_max, f"calibrating acceptance ({seen}/{self.calibration_rows} row-steps)",
                                         [], [], [], calibrating=True))
        acc = estimate_acceptance(reached, accepted, self.gamma_max)
        if model is None:
            return self._record(Decision(self.gamma_max, "no cost model yet: measuring", [], [], acc))
        d = choose_gamma(model, acc, ctx.rows, ctx.context_len, self.gamma_max, self.min_gain, ctx.rows_apart)
        if model.local is not None:
            d = self._measure_runner_up(d, model.local, ctx.rows, ctx.context_len)
        return self._record(d)

    def _measure_runner_up(self, d: Decision, local: LocalCorrection, rows: int, ctx: float) -> Decision:
        """Where `d` speculates, run plain decoding instead while its measurements at this shape
        need it (module docstring): before speculating here at all, and again once its steps
        here are older than `remeasure_share` allows at its predicted gap."""
        if d.gamma == 0:
            return d
        n = local.count(0, rows, ctx)
        if n < MIN_LOCAL:
            return Decision(0, f"rows={rows}: measuring plain decoding at this shape first ({n}/{MIN_LOCAL} steps) "
                               f"before speculating; then: {d.reason}",
                            d.candidates, d.predicted_goodput, d.acceptance, measuring=True)
        age, visit = local.age(0, rows, ctx), local.visit_steps(0, rows, ctx)
        ongoing = visit < MIN_LOCAL and age <= REVISIT_STEPS          # a re-measure under way
        gap = max(d.predicted_goodput[d.gamma] / max(d.predicted_goodput[0], 1e-12) - 1, self.min_gain)
        if ongoing or age > MIN_LOCAL * gap / self.remeasure_share:
            return Decision(0, f"rows={rows}: re-measuring plain decoding at this shape (last run here {age} steps "
                               f"ago, predicted {gap:.0%} behind; {visit if ongoing else 0}/{MIN_LOCAL} steps); "
                               f"then: {d.reason}",
                            d.candidates, d.predicted_goodput, d.acceptance, measuring=True)
        return d

    def _record(self, d: Decision) -> int:
        self.decisions.append(d)
        return d.gamma


def _add(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two per-depth count lists of any lengths."""
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def row_acceptance(acceptance: list[float], drafted_steps: int, first_hits: int) -> list[float]:
    """The task's a_k scaled for one row by its own first-draft hit rate (shrunk to a_1)."""
    a1 = max(acceptance[0], 1e-6)
    rho = (first_hits + ROW_PRIOR * a1) / (drafted_steps + ROW_PRIOR) / a1
    return [min(a * rho, 0.999) for a in acceptance]


def batch_tokens(acceptance: list[float], rows: int, gamma: int, rows_apart=()) -> float:
    """Expected tokens emitted by one step over `rows` rows: the task's E for the typical rows,
    each row apart with its own acceptance and capped at its budget (module docstring)."""
    total = (rows - len(rows_apart)) * expected_tokens(acceptance, gamma)
    for (left, drafted, hits), same in groupby(rows_apart):     # a large batch's tail repeats a few
        acc = row_acceptance(acceptance, drafted, hits) if drafted else acceptance
        total += expected_tokens(acc, max(0, min(gamma, left - 1))) * sum(1 for _ in same)
    return total


def choose_gamma(model: CostModel, acceptance: list[float], rows: int, ctx: float, gamma_max: int,
                 min_gain: float = 0.0, rows_apart: tuple = ()) -> Decision:
    """argmax over gamma in 0..gamma_max of predicted goodput (ties go to the smaller gamma),
    except that a speculative gamma predicting at most `min_gain` over gamma 0 yields gamma 0.
    `rows_apart`: (tokens left, steps drafted, first-draft hits) of rows priced on their own."""
    candidates = list(range(gamma_max + 1))
    goodput = [batch_tokens(acceptance, rows, g, rows_apart) / max(step_s, 1e-9)
               for g, step_s in zip(candidates, model.step_s_by_gamma(rows, gamma_max, ctx))]
    best = max(candidates, key=lambda g: (goodput[g], -g))
    gain = goodput[best] / goodput[0] if goodput[0] > 0 else float("inf")
    reason = (f"rows={rows}: gamma={best} predicts {goodput[best]:.0f} tok/s, {gain:.2f}x gamma 0 "
              f"(E={expected_tokens(acceptance, best):.2f}, a1={acceptance[0]:.2f})")
    if best == 0:
        reason = f"rows={rows}: no gamma beats plain decoding ({goodput[0]:.0f} tok/s)"
    elif gain <= 1 + min_gain:
        reason = (f"rows={rows}: gamma={best} predicts only {gain:.2f}x gamma 0, within the "
                  f"{min_gain:.0%} margin: plain decoding ({goodput[0]:.0f} tok/s)")
        best = 0
    return Decision(best, reason, candidates, goodput, acceptance)


def make_policy(gamma) -> GammaPolicy:
    """A policy object for an int gamma, or the caller's own policy. ("auto" with MTP heads is
    a GoodputPolicy that needs the engine's cost model: see Engine.auto_policy.)"""
    if hasattr(gamma, "choose"):
        return gamma
    if gamma == "auto":
        return FixedGamma(0, "auto: no MTP heads (or gamma_max 0), so no speculation")
    return FixedGamma(int(gamma))
