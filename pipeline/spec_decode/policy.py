"""Choosing gamma, the number of drafts per verify step, for throughput.

    E(gamma)       = 1 + sum_{j=1..gamma} prod_{k<=j} a_k            (tokens per row per step)
    goodput(gamma) = rows * E(gamma) / (T_verify(rows, gamma+1, ctx) + T_draft(rows, gamma) + T_overhead(rows))

`GoodputPolicy` is asked before every step and picks the gamma in 0..gamma_max with the highest
predicted goodput, from per-depth acceptance a_k (earlier shards of the task as a prior, plus
this call) and the engine's fitted cost model (pipeline.spec_decode.cost). gamma 0 is always a
candidate: where the accelerator is compute-bound, verifying gamma + 1 tokens costs about
gamma + 1 times one and speculation loses. Speculation must predict more than `min_gain` over
gamma 0 to be chosen, since predictions carry a few percent of error.

- Calibration: a task with fewer than `calibration_rows` drafted row-steps runs gamma_max, which
  observes every depth at once; not where the prior stands for one (`calibrated`: a checkpoint's
  held-out acceptance, weighed by how far its tasks differ, so a call's drafts soon outweigh
  it). A calibrated task that settles on gamma 0 observes no more drafts, so the estimate has
  to span enough rows to live on. A call that names no task the checkpoint holds starts from
  its tasks as a mixture (`mixture`, pipeline.spec_decode.prior_mix) that its drafts weigh.
- Exploring: plain decoding drafts nothing, so an acceptance estimate that picks it is never
  corrected. Where the mean picks gamma 0 but `optimism` posterior deviations more acceptance
  would speculate (a weak prior, a few drafts seen), the shallowest gamma that pays under that
  view runs, re-decided every step; the deviation shrinks with each drafted row-step. Likewise
  deeper: gamma g observes no depth beyond g, so where that view picks deeper than the mean's
  g >= 1, g + 1 runs.
- A row's heads' prompt fill, and the tokens of its gamma-0 steps (the backlog), wait until
  the row next drafts (pipeline.engine.drafter), so the next speculative step pays them:
  `StepContext.waiting_fill_s`, the waiting fills' measured seconds per token their rows are
  expected to produce still (the median output length of the task's recent rows, or the
  call's), is added to a speculative step's cost E(gamma) times.
  Rows with 7 tokens to go after a 114-token prompt on the demo's 4-layer target do not start
  drafting; rows with 60 do.
- Rows priced apart (`StepContext.rows_apart`), the rest at the task's E: a row with r tokens
  left gains nothing from drafts beyond r - 1; at a shard's tail (none queued, at most
  `FEW_ROWS` active of a batch that had more) each row's own first-draft hit rate scales the
  task's a_k (Beta prior of weight `ROW_PRIOR`). This is the one way gamma drops as a batch shrinks.
- Plain decoding priced by its own steps: where a speculative gamma would be chosen but the cost
  model's local correction holds fewer than MIN_LOCAL gamma-0 steps at this (rows, context)
  bucket, or they are older than MIN_LOCAL * gap / `remeasure_share` engine steps (gap: how far
  gamma 0 is predicted behind), gamma 0 runs instead, marked `measuring`. A bucket with no
  gamma-0 steps of its own next to one priced within that age (one context octave away: a row
  decodes into the next octave) borrows that price rather than measuring again. A call that
  took no profile (`plain_first` False) speculates at once: its model is fitted from its own
  steps, gamma 0's among them, and ran 4-6 plain steps of a 28-step json call measuring again.
- Speculation priced by its own steps, on the same budget: at gamma 0, the best speculative
  gamma of those run at this bucket runs MIN_LOCAL steps (marked `measuring`) once its steps
  there are older than MIN_LOCAL * loss / `remeasure_share` engine steps (loss: how far it is
  predicted behind, at least `min_gain`, plus the waiting fills its first step runs,
  `StepContext.waiting_fill_total_s`, spread over its MIN_LOCAL steps). A price taken in a
  slow spell would otherwise keep a call at gamma 0 for good; the check costs at most
  `remeasure_share` of the steps, scaled by the predicted loss. The budget is the engine's,
  not each bucket's: a re-measure starts only once the last one's MIN_LOCAL * gap /
  `remeasure_share` steps have passed (`LocalCorrection.next_remeasure`). Per bucket, a batch
  of 48 draining through ten rows buckets after a long batch-1 call re-measured every one of
  them: 35 of 126 steps, 10%. Likewise while speculating at g: the best other speculative
  gamma priced by steps of its own at these rows (at this context or the nearest) is
  re-measured on that budget at its predicted loss behind g, since only the gamma run is
  re-priced (`_measure_rival`).
- Near ties priced by their own steps: where a speculative gamma is chosen and another is
  predicted within `min_gain` of it on a borrowed price (no steps of its own at these rows: the
  smooth model times another gamma's measured factor), that gamma runs MIN_LOCAL steps, marked
  `measuring`, once per rows bucket: the smooth model's one slope over gamma priced a depth at
  one row ~0.44 ms where the steps took ~0.27 (docs/decisions.md, stop 61).
- No cost model yet (a call of a few rows on an engine with no profile, in memory or on disk,
  takes none: pipeline.engine.warm_start): `explore` runs gamma 0, gamma_max and one between
  on real steps, the three shapes the model is then fitted from.
- Reuse: a decision stands for `recheck_steps` steps (`recheck_plain_steps` for gamma 0, which
  moves no acceptance estimate) of its shape (rows, context bucket, rows apart, waiting fill)
  under the same cost model. Each recent shape keeps its own: a step with the heads' fill
  waiting and one without alternate where rows switch sources, and re-deciding at every switch
  was 0.1 ms of a 5 ms batch-1 step.
- The plan: calibration happens once per run, not per actor. The driver's plan
  (pipeline.spec_decode.plan) hands each policy the run's evidence as its prior; a policy told
  not to calibrate (`calibrate=False`: another shard is calibrating the task) runs the plan's
  gamma (`planned`) until its own evidence suffices.

Example: a = [0.8, 0.5] gives E = 1, 1.8, 2.2 at gamma 0, 1, 2; at 8 rows with whole steps of
10, 14 and 20 ms, goodput is 800, 1029 and 880 tokens/s, so gamma 1 (29% over gamma 0) is chosen.
What was measured to arrive at these rules: docs/decisions.md (2026-11-29).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import groupby
from typing import Callable, Protocol, Sequence

from pipeline.spec_decode.cost import MIN_LOCAL, REVISIT_STEPS, CostModel, LocalCorrection
from pipeline.spec_decode.prior_mix import PriorMixture
from pipeline.spec_decode.stats import SpecStats

FEW_ROWS = 8            # at a tail (none queued), at most this many rows: each priced with its own acceptance
ROW_PRIOR = 4.0         # weight (row-steps) of the task's a_1 in a row's own first-draft estimate
MEMO_KEYS = 64          # step shapes whose decisions the policy keeps (cleared when full or refitted)


@dataclass(frozen=True)
class StepContext:
    rows: int               # active rows in the coming verify step
    context_len: float      # cached tokens the step attends (the longest row's: StepRecord.context_len)
    stats: SpecStats        # what this generate call has measured so far
    rows_apart: tuple[tuple[int, int, int], ...] = ()   # (tokens left, steps drafted, first-draft hits)
    waiting_fill_s: float = 0.0     # the heads' waiting fills (prompts, backlogs), s per token their rows have left
    waiting_fill_total_s: float = 0.0   # ... and in all: what the next speculative step runs first


class GammaPolicy(Protocol):
    decisions: Sequence["Decision"]     # why each step chose its gamma (empty when nothing was decided)

    def choose(self, ctx: StepContext) -> int: ...
    def max_gamma(self) -> int: ...


@dataclass(frozen=True)
class FixedGamma:
    gamma: int
    reason: str = "fixed by caller"

    @property
    def decisions(self) -> tuple["Decision", ...]:
        """Nothing is decided per step: every step uses `gamma` (`reason` says why)."""
        return ()

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
    exploring: bool = False             # speculation the mean acceptance would not pick (GoodputPolicy.optimism)


def upper_acceptance(reached: list[int], accepted: list[int], depth: int, z: float = 1.0,
                     prior_weight: float = 4.0) -> list[float]:
    """a_1..a_depth `z` posterior deviations above `estimate_acceptance` (Beta posterior of
    reached + prior_weight row-steps per depth), at most 0.99. Example: 15 of 20 accepted at
    depth 1: mean (15 + 2) / 24 = 0.71, deviation sqrt(0.71 * 0.29 / 25) = 0.09, so 0.80."""
    mean = estimate_acceptance(reached, accepted, depth, prior_weight=prior_weight)
    out = []
    for k, m in enumerate(mean):
        n = (reached[k] if k < len(reached) else 0) + prior_weight
        out.append(min(m + z * math.sqrt(m * (1 - m) / (n + 1)), 0.99))
    return out


@dataclass
class GoodputPolicy:
    gamma_max: int
    cost: Callable[[], CostModel | None]        # current fitted cost model (refined online)
    prior: SpecStats = field(default_factory=SpecStats)   # earlier shards of this task
    calibration_rows: int = 256
    recheck_steps: int = 8
    recheck_plain_steps: int = 32       # a gamma-0 decision: no drafts, so no acceptance moves meanwhile
    min_gain: float = 0.05
    optimism: float = 1.0               # posterior deviations of acceptance a gamma-0 decision explores by (0: none)
    remeasure_share: float = 0.005      # what re-measuring gamma 0 while speculating may cost (share of steps x gap)
    planned: int | None = None          # the driver's plan (pipeline.spec_decode.plan): run while evidence is short
    calibrate: bool = True              # False: another shard calibrates this task; do not calibrate here
    calibrated: bool = False            # the prior stands for a calibration (a checkpoint's held-out
                                        # acceptance at every depth), however few row-steps it weighs
    mixture: PriorMixture | None = None  # a checkpoint's tasks, weighed by this call's drafts (added to `prior`)
    plain_first: bool = True            # measure plain decoding at a new shape before speculating there
                                        # (False: no profile, so the model's prices are this call's own steps)
    decisions: list[Decision] = field(default_factory=list)
    _memo: dict = field(default_factory=dict, repr=False)       # step shape -> (decision, steps it ran)
    _memo_model: int | None = field(default=None, repr=False)   # id of the cost model the memo priced by
    _remeasures: dict = field(default_factory=dict, repr=False)  # bucket -> steps of a re-measure this policy runs
    _plain: tuple | None = field(default=None, repr=False)     # (rows, bucket, model id, memo key): a standing gamma 0

    def max_gamma(self) -> int:
        return self.gamma_max

    def choose(self, ctx: StepContext) -> int:
        model = self.cost()
        waiting = round(math.log2(ctx.waiting_fill_s)) if ctx.waiting_fill_s > 0 else None   # by halves
        key = (ctx.rows, int(ctx.context_len) // 64, ctx.rows_apart, waiting)
        if self._memo_model != id(model) or len(self._memo) >= MEMO_KEYS:
            self._memo, self._memo_model = {}, id(model)     # a refit prices every shape anew
        hit = self._reuse(key)
        if hit is not None:
            self._plain = (ctx.rows, key[1], id(model), key) if self._clearly_plain(hit) else None
            return hit.gamma
        gamma = self._decide(ctx, model)
        d = self.decisions[-1]
        if d.predicted_goodput and not (d.measuring or d.exploring):
            self._memo[key] = (d, 1)
        else:                              # not while measuring or exploring: each such step's evidence may end it
            self._memo.pop(key, None)
        self._plain = (ctx.rows, key[1], id(model), key) if key in self._memo and self._clearly_plain(d) else None
        return gamma

    def _clearly_plain(self, d: Decision) -> bool:
        """A gamma-0 decision every speculative gamma is predicted to lose by more than `min_gain`:
        one that may stand unpriced (`plain_stands`). A near tie is priced at every step as the
        memo has it: at batch 1 the model's few percent of error decide it, and standing held
        plain decoding for 32 steps at a time where speculation measured 1.3x (docs/decisions.md,
        stop 53)."""
        gp = d.predicted_goodput
        return d.gamma == 0 and len(gp) > 1 and max(gp[1:]) * (1 + self.min_gain) < gp[0]

    def plain_stands(self, rows: int, context_len: float) -> bool:
        """Whether the last step's gamma-0 decision, a clear one (`_clearly_plain`), stands for
        this step too, asked before `choose` and without its inputs that move from step to step
        at one shape: the heads' waiting fills grow by a token a row each plain step, and rows
        come within reach of their budget; both only make speculating dearer or its gain
        smaller, so neither turns plain decoding into speculation. Not so a row admitted
        meanwhile, with its budget ahead of it: the caller asks only where none was
        (pipeline.engine.run). Same rows, context bucket and cost model; it counts as a reuse
        of the memo's decision (`recheck_plain_steps`), and the step's decision is it. Building
        those inputs and pricing was ~0.1 ms of host time a step at 32 rows, about 1% of a
        plain step there (docs/decisions.md, stop 53)."""
        p = self._plain
        if p is None or p[0] != rows or p[1] != int(context_len) // 64 or p[2] != id(self.cost()):
            return False
        return self._reuse(p[3]) is not None

    def _reuse(self, key: tuple) -> Decision | None:
        """The memo's decision at `key` once more, where it has not stood for its `recheck_steps`
        (`recheck_plain_steps` at gamma 0) yet: counted, and recorded as this step's; else None."""
        hit = self._memo.get(key)
        if hit is None or hit[1] >= (self.recheck_steps if hit[0].gamma else self.recheck_plain_steps):
            return None
        self._memo[key] = (hit[0], hit[1] + 1)
        self.decisions.append(hit[0])
        return hit[0]

    def _decide(self, ctx: StepContext, model: CostModel | None) -> int:
        reached, accepted = _add(self.prior.reached, ctx.stats.reached), _add(self.prior.accepted, ctx.stats.accepted)
        if self.mixture is not None:
            mix = self.mixture.prior(reached, accepted)
            reached, accepted = _add(mix.reached, reached), _add(mix.accepted, accepted)
        seen = reached[0] if reached else 0
        if self.gamma_max == 0:
            return self._record(Decision(0, "gamma_max is 0", [0], [], []))
        short = seen < self.calibration_rows and not self.calibrated     # too little evidence to price by
        if short and not self.calibrate:
            g = min(self.planned or 0, self.gamma_max)
            return self._record(Decision(g, f"the plan's gamma {g}: too little evidence ({seen} row-steps) and "
                                            "calibration of this task is under way elsewhere", [], [], []))
        if short:
            return self._record(Decision(self.gamma_max, f"calibrating acceptance ({seen}/{self.calibration_rows} row-steps)",
                                         [], [], [], calibrating=True))
        acc = estimate_acceptance(reached, accepted, self.gamma_max)
        if model is None:
            return self._record(explore(ctx, acc, self.gamma_max))
        d = self._priced(model, acc, ctx)
        if d.gamma == 0 and self.optimism > 0:
            d = self._explore_upward(d, model, ctx, reached, accepted)
        elif d.gamma < self.gamma_max and self.optimism > 0:
            d = self._explore_deeper(d, model, ctx, reached, accepted)
        if model.local is not None:
            d = self._measure_runner_up(d, model.local, ctx.rows, ctx.context_len)
            d = self._measure_speculation(d, model.local, ctx.rows, ctx.context_len, ctx.waiting_fill_total_s)
            d = self._measure_near_tie(d, model.local, ctx.rows, ctx.context_len)
            d = self._measure_rival(d, model.local, ctx.rows, ctx.context_len)
        return self._record(d)

    def _priced(self, model: CostModel, acceptance: list[float], ctx: StepContext) -> Decision:
        """`choose_gamma` at this step's shape under `acceptance` (the mean's, or an optimistic view)."""
        return choose_gamma(model, acceptance, ctx.rows, ctx.context_len, self.gamma_max, self.min_gain,
                            ctx.rows_apart, ctx.waiting_fill_s)

    def _explore_upward(self, d: Decision, model: CostModel, ctx: StepContext, reached, accepted) -> Decision:
        """Where the mean acceptance picks plain decoding, the gamma that `optimism` posterior
        deviations more acceptance would pick, if any: plain decoding drafts nothing, so an
        estimate that is low (a weak prior, a few unlucky drafts) would otherwise never be
        corrected. It explores at the shallowest gamma that pays under that view: the first
        depth's acceptance decides most, and a deep draft that is rejected costs the most. The
        deviation shrinks as drafts are seen, so exploring ends by itself."""
        hi = upper_acceptance(reached, accepted, self.gamma_max, self.optimism)
        gp = d.predicted_goodput           # E's ratio at the same step cost bounds the optimistic goodput
                                           # (rows priced apart aside): a cheap test before pricing again
        bound = max((gp[g] * expected_tokens(hi, g) / expected_tokens(d.acceptance, g) for g in range(1, len(gp))),
                    default=0.0)
        if bound <= gp[0] * (1 + self.min_gain):
            return d                       # where even that cannot pay, the mean's choice stands unpriced
        e = self._priced(model, hi, ctx)
        if e.gamma == 0:
            return d
        g = min(k for k in e.candidates if k and e.predicted_goodput[k] > e.predicted_goodput[0] * (1 + self.min_gain))
        return Decision(g, f"rows={ctx.rows}: exploring gamma {g}: plain decoding by the mean "
                           f"(a1={d.acceptance[0]:.2f}), gamma {e.gamma} at {self.optimism:g} posterior "
                           f"deviation(s) more acceptance (a1={hi[0]:.2f}, {reached[0] if reached else 0} row-steps); "
                           f"the shallowest gamma that pays then",
                        d.candidates, d.predicted_goodput, d.acceptance, exploring=True)

    def _explore_deeper(self, d: Decision, model: CostModel, ctx: StepContext, reached, accepted) -> Decision:
        """Where the mean picks gamma g >= 1 but `optimism` posterior deviations more acceptance
        would pick a deeper gamma by more than `min_gain`, run g + 1: depths beyond the gamma run
        are never observed, so a prior that is low there (another task's, pooled) would otherwise
        hold the policy shallow for good. One depth at a time; the deviation shrinks as that
        depth is seen, and near-ties are left alone (optimism would probe them for long).
        Example: a fresh engine on json with the checkpoint's pooled prior (a_1 0.66) ran gamma 1
        for most of a 4-prompt call where gamma 5 was 1.4x faster."""
        hi = upper_acceptance(reached, accepted, self.gamma_max, self.optimism)
        e = self._priced(model, hi, ctx)
        if e.gamma <= d.gamma or e.predicted_goodput[e.gamma] <= e.predicted_goodput[d.gamma] * (1 + self.min_gain):
            return d
        g = d.gamma + 1
        n = reached[g - 1] if len(reached) >= g else 0
        return Decision(g, f"rows={ctx.rows}: exploring gamma {g}: gamma {d.gamma} by the mean, gamma {e.gamma} at "
                           f"{self.optimism:g} posterior deviation(s) more acceptance ({n} row-steps at depth {g}); "
                           f"one depth deeper",
                        d.candidates, d.predicted_goodput, d.acceptance, exploring=True)

    def _measure_runner_up(self, d: Decision, local: LocalCorrection, rows: int, ctx: float) -> Decision:
        """Where `d` speculates, run plain decoding instead while its measurements at this shape
        need it (module docstring): before speculating here at all (`plain_first`), and again
        once its steps here are older than `remeasure_share` allows at its predicted gap."""
        if d.gamma == 0:
            return d
        n = local.count(0, rows, ctx)
        gap = max(d.predicted_goodput[d.gamma] / max(d.predicted_goodput[0], 1e-12) - 1, self.min_gain)
        due = MIN_LOCAL * gap / self.remeasure_share           # steps a gamma-0 price may age at this gap
        if n == 0 and (near := local.nearby_age(0, rows, ctx)) is not None and near <= due:
            return d                                           # priced by the next octave's plain steps
        if n < MIN_LOCAL and self.plain_first:
            return Decision(0, f"rows={rows}: measuring plain decoding at this shape first ({n}/{MIN_LOCAL} steps) "
                               f"before speculating; then: {d.reason}",
                            d.candidates, d.predicted_goodput, d.acceptance, measuring=True)
        if n == 0:
            return d                                           # never run here: priced by the call's own steps
        return self._remeasure(d, 0, "plain decoding", gap, local, rows, ctx)

    def _measure_speculation(self, d: Decision, local: LocalCorrection, rows: int, ctx: float,
                             fills_s: float = 0.0) -> Decision:
        """Where `d` is plain decoding by prediction, run the best speculative gamma instead once
        its price at this shape is older than the budget allows (module docstring). Its first
        step runs the heads over every waiting fill (`fills_s` seconds), work lost if plain
        decoding stays ahead: counted in the re-measure's loss, spread over its MIN_LOCAL steps.
        Example: 48 rows at gamma 0 after admission, fills of 1.5 plain steps: a gamma 1
        predicted 5% behind loses 0.05 + 1.5 / 4 = 0.43 of each of its steps, so it is
        re-measured 8.5x less often."""
        goodput = d.predicted_goodput
        if d.gamma != 0 or d.measuring or len(goodput) < 2 or goodput[0] <= 0:
            return d
        ran = [k for k in range(1, len(goodput)) if local.age(k, rows, ctx) is not None]
        if not ran:
            return d                       # none run at this shape: their prices are borrowed, not stale
        g = max(ran, key=lambda k: (goodput[k], -k))
        plain_step_s = rows / goodput[0]
        loss = max(1 - goodput[g] / goodput[0], self.min_gain) + fills_s / plain_step_s / MIN_LOCAL
        return self._remeasure(d, g, f"gamma {g}", loss, local, rows, ctx)

    def _measure_near_tie(self, d: Decision, local: LocalCorrection, rows: int, ctx: float) -> Decision:
        """Where `d` speculates at gamma g, the best speculative gamma predicted within `min_gain`
        of g on a borrowed price (`LocalCorrection.priced_by_own` false) runs instead, marked
        `measuring`, until MIN_LOCAL steps price it (module docstring, "Near ties"). Once per
        gamma and rows bucket, each step at a predicted loss under `min_gain`."""
        gp = d.predicted_goodput
        if d.gamma == 0 or d.measuring or d.exploring or not gp:
            return d
        near = [g for g in range(1, len(gp)) if g != d.gamma and gp[g] * (1 + self.min_gain) >= gp[d.gamma]
                and not local.priced_by_own(g, rows, ctx)]
        if not near:
            return d
        g = max(near, key=lambda k: (gp[k], -k))
        return Decision(g, f"rows={rows}: measuring gamma {g} at this shape ({local.count(g, rows, ctx)}/{MIN_LOCAL} "
                           f"steps): predicted {1 - gp[g] / gp[d.gamma]:.1%} behind gamma {d.gamma} on another "
                           f"gamma's price; then: {d.reason}",
                        d.candidates, gp, d.acceptance, measuring=True)

    def _measure_rival(self, d: Decision, local: LocalCorrection, rows: int, ctx: float) -> Decision:
        """Where `d` speculates at gamma g, the best other speculative gamma priced by steps of its
        own at these rows is re-measured on the budget plain decoding's price is (`_remeasure`,
        its loss how far it is predicted behind g): a price taken in a slow spell would
        otherwise hold the policy at g for good, since only the gamma run is re-priced.
        Example: at one row gamma 2's steps, run in a slow spell, read 2.9x the model where
        gamma 1's read 1.2-2.2x; auto ran gamma 1 on ~95% of its steps, at 0.84-1.02x fixed
        gamma 2's speed over six calls (docs/decisions.md, stop 62)."""
        gp = d.predicted_goodput
        if d.gamma == 0 or d.measuring or d.exploring or not gp:
            return d
        own = [k for k in range(1, len(gp)) if k != d.gamma and local.priced_by_own(k, rows, ctx)]
        if not own:
            return d
        g = max(own, key=lambda k: (gp[k], -k))
        gap = max(1 - gp[g] / gp[d.gamma], self.min_gain)
        return self._remeasure(d, g, f"gamma {g}", gap, local, rows, ctx)

    def _remeasure(self, d: Decision, gamma: int, what: str, gap: float, local: LocalCorrection, rows: int,
                   ctx: float) -> Decision:
        """`d`, or `gamma` run instead of it while this policy's re-measure of that shape is
        under way or due (`_remeasured`). Under way means this policy started it: steps a
        caller's fixed-gamma call ran at the shape just before are no re-measure to finish
        (they had an auto call run a gamma predicted 91% behind at a batch's tail)."""
        key = local.key(gamma, rows, ctx)
        done = self._remeasures.get(key, 0)
        started = 0 < done < MIN_LOCAL
        r = _remeasured(d, gamma, what, gap, local, rows, ctx, self.remeasure_share, started)
        if r is None:
            self._remeasures.pop(key, None)
            return d
        if not started:                    # a new re-measure waits out the engine-wide budget of the last
            if local.clock < local.next_remeasure:
                return d
            local.next_remeasure = local.clock + MIN_LOCAL * gap / self.remeasure_share
        self._remeasures[key] = done + 1 if done < MIN_LOCAL else 1
        return r

    def _record(self, d: Decision) -> int:
        self.decisions.append(d)
        return d.gamma


def _remeasured(d: Decision, gamma: int, what: str, gap: float, local: LocalCorrection, rows: int, ctx: float,
                share: float, started: bool = False) -> Decision | None:
    """`gamma` run instead of `d`, marked measuring, while a re-measure of its price at this shape
    is under way (`started` by the policy, fewer than MIN_LOCAL steps since the bucket was
    revisited) or due: its steps here are older than MIN_LOCAL * gap / share policy steps (gap:
    what it is predicted to lose per step: how far behind, and a speculation's waiting fills).
    None when its price stands."""
    age, visit = local.age(gamma, rows, ctx), local.visit_steps(gamma, rows, ctx)
    if age is None:                    # not run at this context: its price is its nearest context's
        age = local.own_age(gamma, rows, ctx)
    if age is None:
        return None
    ongoing = started and visit < MIN_LOCAL and age <= REVISIT_STEPS          # a re-measure under way
    if not ongoing and age <= MIN_LOCAL * gap / share:
        return None
    return Decision(gamma, f"rows={rows}: re-measuring {what} at this shape (last run here {age} steps ago, "
                           f"predicted to lose {gap:.0%} of each step; {visit if ongoing else 0}/{MIN_LOCAL} steps); "
                           f"then: {d.reason}",
                    d.candidates, d.predicted_goodput, d.acceptance, measuring=True)


def explore_gammas(gamma_max: int) -> list[int]:
    """The gammas a call without a cost model runs first: plain decoding, the deepest gamma, then
    one between, so the fit's three verify shapes span every width it will price (it interpolates)
    and the deepest depth's acceptance is seen at once. Run as gamma 0, 1, 2, the fit extrapolated
    to 6 tokens from the slope of one noisy step: a fresh call on complete then ran gamma 1 on 60
    of 68 steps, 0.71-0.77x the best fixed gamma (docs/decisions.md, stop 37).
    Example: gamma_max 5 -> [0, 5, 2]."""
    return list(dict.fromkeys(g for g in (0, gamma_max, max(1, gamma_max // 2)) if g <= gamma_max))


def explore(ctx: StepContext, acceptance: list[float], gamma_max: int) -> Decision:
    """No cost model yet (a small first call takes no profile: pipeline.engine.warm_start): the
    next of `explore_gammas` this call has not run at this batch size, so its steps give the fit
    the three verify shapes it needs; every such step emits tokens, unlike a profile's forwards.
    Once all ran and still no model (nothing fits), plain decoding.
    Example: a call's first steps at 1 row, gamma_max 5: gamma 0, then 5, then 2, then the
    model decides."""
    ran = {s.gamma for s in ctx.stats.steps if s.rows == ctx.rows}
    todo = [g for g in explore_gammas(gamma_max) if g not in ran]
    if not todo:
        return Decision(0, "no cost model could be fitted: plain decoding", [], [], acceptance)
    return Decision(todo[0], f"rows={ctx.rows}: no cost profile; measuring gamma {todo[0]} on a real step",
                    [], [], acceptance, measuring=True)


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
                 min_gain: float = 0.0, rows_apart: tuple = (), waiting_fill_s: float = 0.0) -> Decision:
    """argmax over gamma in 0..gamma_max of predicted goodput (ties go to the smaller gamma),
    except that a speculative gamma predicting at most `min_gain` over gamma 0 yields gamma 0.
    `rows_apart`: (tokens left, steps drafted, first-draft hits) of rows priced on their own.
    `waiting_fill_s`: the heads' fills of prompts not yet run, per token their rows have left
    (module docstring): a speculative step pays them, spread over those rows' remaining steps,
    E(gamma) tokens a step, so each such step costs E(gamma) * waiting_fill_s more."""
    candidates = list(range(gamma_max + 1))
    goodput = [batch_tokens(acceptance, rows, g, rows_apart)
               / max(step_s + (waiting_fill_s * expected_tokens(acceptance, g) if g else 0.0), 1e-9)
               for g, step_s in zip(candidates, model.step_s_by_gamma(rows, gamma_max, ctx))]
    best = max(candidates, key=lambda g: (goodput[g], -g))
    gain = goodput[best] / goodput[0] if goodput[0] > 0 else float("inf")
    fills = f"; waiting prompt fills {1e3 * waiting_fill_s:.2f} ms per token left" if waiting_fill_s > 0 else ""
    reason = (f"rows={rows}: gamma={best} predicts {goodput[best]:.0f} tok/s, {gain:.2f}x gamma 0 "
              f"(E={expected_tokens(acceptance, best):.2f}, a1={acceptance[0]:.2f}){fills}")
    if best == 0:
        reason = f"rows={rows}: no gamma beats plain decoding ({goodput[0]:.0f} tok/s){fills}"
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
