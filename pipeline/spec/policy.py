"""Choosing gamma, the number of drafts per verify step.

`GammaPolicy.choose` is asked before every step with what the engine knows (active rows, mean
context, running stats); the engine caps the answer at its gamma_max. The measured,
goodput-maximising policy belongs to the distributed-pipeline issue; until it lands, "auto"
is a fixed default, and says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pipeline.spec.stats import SpecStats

DEFAULT_AUTO_GAMMA = 3


@dataclass(frozen=True)
class StepContext:
    rows: int               # active rows in the coming verify step
    context_len: float      # mean cached tokens per row
    stats: SpecStats        # everything measured so far


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


def make_policy(gamma, num_heads: int, gamma_max: int) -> GammaPolicy:
    if hasattr(gamma, "choose"):
        return gamma
    if gamma == "auto":
        if num_heads == 0:
            return FixedGamma(0, "auto: checkpoint has no MTP heads")
        return FixedGamma(min(DEFAULT_AUTO_GAMMA, gamma_max), "auto: fixed default until the measured policy lands")
    return FixedGamma(int(gamma))
