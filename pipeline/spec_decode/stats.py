"""Speculation statistics: mergeable counters and per-step records, apart from logging/export.

Per-depth acceptance a_k = P(draft k accepted | drafts 1..k-1 accepted) = accepted[k] / reached[k],
where reached[k] counts row-steps in which draft k was verified with drafts 1..k-1 all accepted.
Mean acceptance length counts tokens emitted per row per verify step, the recovered or bonus
token included (so 1.0 at gamma 0).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepRecord:
    """One verify step: the cost-model sample (rows, tokens per row, context) and its outcome."""
    gamma: int
    rows: int               # active rows verified together
    query_len: int          # tokens per row in the verify forward (gamma + 1)
    context_len: float      # mean cached tokens per row before the step
    verify_s: float
    draft_s: float
    emitted: int            # tokens emitted over all rows (accepted + 1 per row)
    overhead_s: float = 0.0  # the rest of the step: choosing gamma, emitting tokens, stop checks


@dataclass
class PrefillRecord:
    rows: int
    tokens: int             # padded prompt tokens computed
    seconds: float


@dataclass
class SpecStats:
    reached: list[int] = field(default_factory=list)     # by depth k-1
    accepted: list[int] = field(default_factory=list)    # by depth k-1
    steps: list[StepRecord] = field(default_factory=list)
    prefills: list[PrefillRecord] = field(default_factory=list)
    row_steps: int = 0
    emitted_tokens: int = 0

    def observe_acceptance(self, gamma: int, num_accepted) -> None:
        """num_accepted: accepted drafts per row in one verify step at `gamma` (ints, or a [n] tensor)."""
        if isinstance(num_accepted, torch.Tensor):
            num_accepted = num_accepted.tolist()
        if gamma > len(self.reached):
            grow = gamma - len(self.reached)
            self.reached += [0] * grow
            self.accepted += [0] * grow
        if gamma:
            counts = [0] * (gamma + 1)                 # rows by accepted
            for a in num_accepted:
                counts[a] += 1
            at_least = 0
            for k in range(gamma, 0, -1):          # rows that accepted >= k drafts
                at_least += counts[k]
                self.accepted[k - 1] += at_least
                self.reached[k - 1] += at_least + counts[k - 1]
        self.row_steps += len(num_accepted)
        self.emitted_tokens += sum(num_accepted) + len(num_accepted)

    def observe_step(self, record: StepRecord) -> None:
        self.steps.append(record)

    def observe_prefill(self, record: PrefillRecord) -> None:
        self.prefills.append(record)

    def acceptance_by_depth(self) -> list[float]:
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]

    def mean_acceptance_length(self) -> float:
        return self.emitted_tokens / self.row_steps if self.row_steps else float("nan")

    @property
    def verify_time_s(self) -> float:
        return sum(s.verify_s for s in self.steps)

    @property
    def draft_time_s(self) -> float:
        return sum(s.draft_s for s in self.steps)

    @property
    def host_time_s(self) -> float:
        """The steps' time outside the draft and verify forwards (StepRecord.overhead_s)."""
        return sum(s.overhead_s for s in self.steps)

    @property
    def prefill_time_s(self) -> float:
        return sum(p.seconds for p in self.prefills)

    def merge(self, other: "SpecStats") -> "SpecStats":
        depth = max(len(self.reached), len(other.reached))
        pad = lambda xs: xs + [0] * (depth - len(xs))  # noqa: E731
        return SpecStats(
            reached=[a + b for a, b in zip(pad(self.reached), pad(other.reached))],
            accepted=[a + b for a, b in zip(pad(self.accepted), pad(other.accepted))],
            steps=self.steps + other.steps, prefills=self.prefills + other.prefills,
            row_steps=self.row_steps + other.row_steps,
            emitted_tokens=self.emitted_tokens + other.emitted_tokens)

    def counts(self) -> "SpecStats":
        """The acceptance counters alone (no step records): a compact prior for later shards."""
        return SpecStats(list(self.reached), list(self.accepted), row_steps=self.row_steps,
                         emitted_tokens=self.emitted_tokens)
