"""The engine's knowledge of its own costs: a start-up profile, the steps it has measured since,
the cost model fitted from both, and when that knowledge has gone stale.

Every step the engine runs is `record`ed: it joins the window the smooth model is refitted from
and, where it is a gamma's shape (no n-gram rows), the per-shape local correction
(pipeline.spec_decode.cost.LocalCorrection), which prices it at once; its verify, where every
row computed the same tokens, prices that verify shape (VerifyCorrection).

Stale means re-profile before the next shard, for one of two measured reasons:
- drift: over the last `window` steps at shapes already measured, the step time is off what the
  last steps at the same shape took by more than `drift` x (median ratio, checked every quarter
  window), e.g. a co-tenant appeared or clocks changed. Shapes not yet measured are not
  evidence of drift (the smooth model is off by tens of percent at some shapes; the local
  correction fixes that), and a change the per-shape correction has already followed is not either;
- utilisation: the accelerator's utilisation during a shard (NVML on CUDA, the process's CPU
  share on CPU) moved by more than `util_jump` from what it was when the profile was taken.
  A jump up at the same batch means the device has become compute-bound (or shared), which
  is exactly when a gamma chosen from the old profile over-speculates.
"""
from __future__ import annotations

import statistics
import time
from collections import deque

from pipeline.spec_decode.cost import CostModel, LocalCorrection, VerifyCorrection, cold, fit_cost_model
from pipeline.spec_decode.stats import StepRecord


class CostTracker:
    def __init__(self, keep: int = 2000, refit_every: int = 32, window: int = 32,
                 drift: float = 1.5, util_jump: float = 0.3, fit_steps: int = 512, refit_share: float = 0.002):
        self.profile: list[StepRecord] = []
        self.steps: deque[StepRecord] = deque(maxlen=keep)
        self.local = LocalCorrection()
        self.verify_local = VerifyCorrection()
        self.refit_every, self.drift, self.util_jump = refit_every, drift, util_jump
        self.refit_share = refit_share   # refits may take at most this share of decoding time
        self.fit_steps = fit_steps       # fits use the most recent real steps (a fit's time grows with them)
        self.ratios: deque[float] = deque(maxlen=window)
        self._unchecked = 0               # ratios added since the last drift check
        self.baseline_util: float | None = None
        self.stale_reason: str | None = None
        self.profiles_taken = 0
        self.profile_cached = False      # the current profile came from the on-disk cache (warm_start.py)
        self.fits, self.fit_seconds = 0, 0.0   # how many fits, and their total time (for benchmarks)
        self._model: CostModel | None = None
        self._shapes: set[tuple] = set()  # verify shapes (rows, tokens a row) of the profile and steps since
        self._fit_s = 0.0                 # how long the last fit took
        self._new_steps = 0               # refining steps since the last fit ...
        self._new_work_s = 0.0            # ... and the step time they took
        self.prompt_fills: deque[tuple[float, int]] = deque(maxlen=32)   # the heads' prompt fills: (s, tokens)

    def needs_profile(self) -> bool:
        return not self.profile or self.stale_reason is not None

    def set_profile(self, records: list[StepRecord]) -> None:
        """A new profile: what was measured before it no longer describes the device."""
        self.profile = list(records)
        self.steps.clear()
        self._shapes = {(r.rows, r.query_len) for r in self.profile if r.verify_s > 0}
        self.local = LocalCorrection()
        self.verify_local = VerifyCorrection()
        self.ratios.clear()
        self.baseline_util, self.stale_reason = None, None
        self.profiles_taken += 1
        self._model = None

    def extend_profile(self, records: list[StepRecord]) -> None:
        """Profiled shapes added (a batch larger than any profiled before): what was measured
        stays; the model is refitted with them."""
        self.profile = self.profile + list(records)
        self._shapes.update((r.rows, r.query_len) for r in records if r.verify_s > 0)
        self._model = None

    def model(self) -> CostModel | None:
        """The fitted model over the profile and the recorded steps. Refitted (the online
        refinement) once `refit_every` refining steps have run and their time is at least the
        last fit's / `refit_share`, so refitting costs at most that share of decoding; the local
        correction follows every step in between, so the smooth model only prices shapes not yet
        run. Fewer than 3 verify shapes measured: None at once (no fit can be made; a fixed-gamma
        call at one row count asked for one every step, ~0.1 ms of a 2.7 ms step)."""
        due = self._new_steps >= self.refit_every and self._new_work_s * self.refit_share >= self._fit_s
        if self._model is None and len(self._shapes) < 3:
            return None
        if self._model is None or due:
            t0 = time.perf_counter()
            self._model = fit_cost_model(list(self.steps)[-self.fit_steps:], profile=self.profile, local=self.local,
                                         verify_local=self.verify_local)
            self._fit_s = time.perf_counter() - t0
            self.fits += 1
            self.fit_seconds += self._fit_s
            self._new_steps, self._new_work_s = 0, 0.0
        return self._model

    def record(self, step: StepRecord, refine: bool = True, by_gamma: bool = True, padded: bool = True) -> None:
        """One step the engine ran. `refine`: it ran under the cost-model policy, so it counts
        towards the next refit (steps at a caller's fixed gamma are kept, and priced locally,
        but do not make the auto policy pay for a refit). `by_gamma`: every row drafted the
        step's gamma with the heads, or none did; a step with n-gram rows is no gamma's shape,
        so it joins the fit window (verify priced by the tokens it computed, drafting by
        source) but neither the per-gamma correction nor the drift check. Every step whose rows
        all verified the same number of tokens in one padded forward (`padded`) prices that verify
        shape (VerifyCorrection): a packed verify runs each token as its own query row with a cache
        gather, so its mean tokens per row (always whole at one row) is not that shape's cost.
        A step just after a prefill of the whole batch (`cold`) joins the fit window only."""
        self.steps.append(step)
        if step.verify_s > 0:
            self._shapes.add((step.rows, step.query_len))
        if refine:
            self._new_steps += 1
            self._new_work_s += step.verify_s + step.draft_s
        if cold(step):          # partly the prefill's cost (spec_decode.cost.COLD_STEPS): no shape's price
            return
        if padded and self.verify_local.takes(step):
            self.verify_local.add(step, self._model, tick=refine)
        if not by_gamma:
            return
        model = self._model
        key = self.local.key(step.gamma, step.rows, step.context_len)
        if model is not None:
            factor = self.local.factors.get(key)
            if factor is not None:
                predicted = self.local.priced(model, step.gamma, step.rows, step.context_len,
                                              self.local.extra(step)) * factor
                if predicted > 0:
                    self.ratios.append(self.local.seconds(step) / predicted)
                    self._check_drift()
        self.local.add(step, model, key, tick=refine)

    def _check_drift(self) -> None:
        """Every quarter window (a median per step would cost more than the check is worth)."""
        self._unchecked += 1
        full = len(self.ratios) == self.ratios.maxlen
        if full and self._unchecked >= self.ratios.maxlen // 4 and self.stale_reason is None:
            self._unchecked = 0
            ratio = statistics.median(self.ratios)
            if not 1 / self.drift <= ratio <= self.drift:
                self.stale_reason = f"measured steps take {ratio:.2f}x what was measured at their shapes"

    def note_prompt_fill(self, seconds: float, tokens: int) -> None:
        """The heads' fill of prompts, run at their rows' first drafted step (pipeline.engine.drafter)."""
        if tokens > 0:
            self.prompt_fills.append((seconds, tokens))

    def prompt_fill_s(self, tokens: int) -> float | None:
        """Seconds the heads' fill of `tokens` waiting tokens (one step's prompts and backlogs)
        is expected to take: a line, fixed part plus per token, through the recent fills, at
        most their mean per token. Fills come at every size, from one row's prompt to a batch's,
        and the fixed part makes small ones dear per token. After a batch-1 call of json
        prompts, the mean priced a 48-row fill of 1,013 tokens at 54 ms; it took 22 ms, and
        the line prices it at about 20 (docs/decisions.md, stop 38). None before any fill."""
        if not self.prompt_fills:
            return None
        ts = [t for _, t in self.prompt_fills]
        ss = [s for s, _ in self.prompt_fills]
        mean = sum(ss) / sum(ts) * tokens
        mt, ms = sum(ts) / len(ts), sum(ss) / len(ss)
        var = sum((t - mt) ** 2 for t in ts)
        if var <= 0:
            return mean
        slope = sum((t - mt) * (x - ms) for t, x in zip(ts, ss)) / var
        fixed = ms - slope * mt
        if slope <= 0 or fixed < 0:           # noise, or no fixed part to see: the mean
            return mean
        return min(fixed + slope * tokens, mean)

    def note_utilization(self, utilization: float | None) -> None:
        if utilization is None:
            return
        if self.baseline_util is None:
            self.baseline_util = utilization
        elif abs(utilization - self.baseline_util) > self.util_jump:
            self.stale_reason = (f"utilisation moved from {self.baseline_util:.2f} to {utilization:.2f} "
                                 "since the cost profile")
