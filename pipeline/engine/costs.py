"""The engine's knowledge of its own costs: a start-up profile, the steps it has measured since,
the cost model fitted from both, and when that knowledge has gone stale.

Stale means re-profile before the next shard, for one of two measured reasons:
- drift: over the last `window` steps the measured step time is off the model's prediction by
  more than `drift` x (median ratio), e.g. a co-tenant appeared or clocks changed;
- utilisation: the accelerator's utilisation during a shard (NVML on CUDA, the process's CPU
  share on CPU) moved by more than `util_jump` from what it was when the profile was taken.
  A jump up at the same batch means the device has become compute-bound (or shared), which
  is exactly when a gamma chosen from the old profile over-speculates.
"""
from __future__ import annotations

import statistics
import time
from collections import deque

from pipeline.spec.cost import CostModel, fit_cost_model
from pipeline.spec.stats import StepRecord


class CostTracker:
    def __init__(self, keep: int = 2000, refit_every: int = 32, window: int = 64,
                 drift: float = 1.5, util_jump: float = 0.3, fit_steps: int = 512):
        self.profile: list[StepRecord] = []
        self.steps: deque[StepRecord] = deque(maxlen=keep)
        self.refit_every, self.drift, self.util_jump = refit_every, drift, util_jump
        self.fit_steps = fit_steps       # fits use the most recent real steps (a fit over 2000 takes ~80 ms)
        self.ratios: deque[float] = deque(maxlen=window)
        self.baseline_util: float | None = None
        self.stale_reason: str | None = None
        self.profiles_taken = 0
        self._model: CostModel | None = None
        self._fit_s = 0.0                 # how long the last fit took
        self._new_steps = 0               # steps seen since the last fit ...
        self._new_work_s = 0.0            # ... and the step time they took
        self._pending_seen = 0

    def needs_profile(self) -> bool:
        return not self.profile or self.stale_reason is not None

    def set_profile(self, records: list[StepRecord]) -> None:
        self.profile = list(records)
        self.steps.clear()
        self.ratios.clear()
        self.baseline_util, self.stale_reason = None, None
        self.profiles_taken += 1
        self._model = None

    def model(self, pending: list[StepRecord] = ()) -> CostModel | None:
        """The fitted model over profile + observed + `pending` steps (the current call's).
        Refitted (the online refinement) once `refit_every` new steps have run and their time
        is at least 100x the last fit's, so refitting costs at most ~1% of decoding."""
        if len(pending) < self._pending_seen:          # a new generate call
            self._pending_seen = 0
        for s in pending[self._pending_seen:]:
            self._new_steps += 1
            self._new_work_s += s.verify_s + s.draft_s
        self._pending_seen = len(pending)
        due = self._new_steps >= self.refit_every and self._new_work_s >= 100 * self._fit_s
        if self._model is None or due:
            t0 = time.perf_counter()
            recent = (list(self.steps) + list(pending))[-self.fit_steps:]
            self._model = fit_cost_model(recent, profile=self.profile)
            self._fit_s = time.perf_counter() - t0
            self._new_steps, self._new_work_s = 0, 0.0
        return self._model

    def observe(self, steps: list[StepRecord]) -> None:
        """Record a generate call's steps and check the model's predictions against them."""
        model = self._model
        for s in steps:
            self.steps.append(s)
            if model is not None:
                predicted = model.compute_s(s.rows, s.gamma, s.context_len)
                if predicted > 0:
                    self.ratios.append((s.verify_s + s.draft_s) / predicted)
        if len(self.ratios) == self.ratios.maxlen:
            ratio = statistics.median(self.ratios)
            if not 1 / self.drift <= ratio <= self.drift:
                self.stale_reason = f"measured steps take {ratio:.2f}x the cost model's prediction"

    def note_utilization(self, utilization: float | None) -> None:
        if utilization is None:
            return
        if self.baseline_util is None:
            self.baseline_util = utilization
        elif abs(utilization - self.baseline_util) > self.util_jump:
            self.stale_reason = (f"utilisation moved from {self.baseline_util:.2f} to {utilization:.2f} "
                                 "since the cost profile")
