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
    query_len: float        # tokens per row the verify forward computed: gamma + 1, or their mean (ragged rows)
    context_len: float      # cached tokens the step attends: the longest row's, before the step
    verify_s: float
    draft_s: float
    emitted: int            # tokens emitted over all rows (accepted + 1 per row)
    overhead_s: float = 0.0  # the rest of the step: choosing gamma, emitting tokens, stop checks
    lookup_s: float = 0.0   # of draft_s, host-side drafting: the n-gram lookup and the per-row choice
    fill_tokens: int = -1   # of draft_s, tokens the heads' fill of the last step ran (its rows x its
                            # verify width); -1: not recorded (read as rows x (gamma + 1))
    shared_s: float = 0.0   # of overhead_s, work paid whatever the gamma: choosing it, releasing
                            # finished rows (not part of a gamma's price: cost.LocalCorrection)
    after_prefill: int = -1  # steps since a prefill admitted every active row (0: the first after it; such
                             # steps price no shape: cost.COLD_STEPS); -1: none in this call, or not recorded


@dataclass
class PrefillRecord:
    rows: int               # prompts prefilled (0: the heads' deferred fill of prompts already counted)
    tokens: int             # padded prompt tokens computed (0 likewise)
    seconds: float


@dataclass
class SpecStats:
    reached: list[int] = field(default_factory=list)     # by depth k-1
    accepted: list[int] = field(default_factory=list)    # by depth k-1
    steps: list[StepRecord] = field(default_factory=list)
    prefills: list[PrefillRecord] = field(default_factory=list)
    row_steps: int = 0
    emitted_tokens: int = 0
    drafted_by_source: dict[str, int] = field(default_factory=dict)     # draft tokens verified, per source
    accepted_by_source: dict[str, int] = field(default_factory=dict)    # of those, accepted
    source_reached: dict[str, list[int]] = field(default_factory=dict)  # per source (and match key), by depth
    source_accepted: dict[str, list[int]] = field(default_factory=dict)

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

    def observe_ragged(self, draft_len: list[int], num_accepted: list[int], depth_rows=None,
                       depth_len: list[int] | None = None) -> None:
        """One verify step whose rows carry their own draft counts. The per-depth counters (the
        MTP policy's evidence) count only `depth_rows` (indices; default all rows), each up to its
        `depth_len` (default its draft_len: a heads row's n-gram tail is not the heads'); every
        row counts towards row steps and emitted tokens."""
        rows = range(len(draft_len)) if depth_rows is None else depth_rows
        depth_len = draft_len if depth_len is None else depth_len
        add_ragged_counts(self.reached, self.accepted, [depth_len[i] for i in rows],
                          [min(num_accepted[i], depth_len[i]) for i in rows])
        self.row_steps += len(num_accepted)
        self.emitted_tokens += sum(num_accepted) + len(num_accepted)

    def observe_source(self, source: str, draft_len: list[int], num_accepted: list[int],
                       key: str | None = None) -> None:
        """Rows of one step drafted by `source` with their own draft counts. Depth counts go
        under `key` (default: the source; e.g. "ngram:3" for a 3-token match)."""
        self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + sum(draft_len)
        self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + sum(num_accepted)
        key = key or source
        reached = self.source_reached.setdefault(key, [])
        accepted = self.source_accepted.setdefault(key, [])
        add_ragged_counts(reached, accepted, draft_len, num_accepted)

    def count_drafted(self, source: str, drafts: int) -> None:
        """Drafts verified that no row reached (a tail behind a rejected heads' draft): they
        count as drafted, and are no evidence of their source's acceptance."""
        self.drafted_by_source[source] = self.drafted_by_source.get(source, 0) + drafts
        self.accepted_by_source.setdefault(source, 0)

    def observe_step(self, record: StepRecord) -> None:
        self.steps.append(record)

    def observe_prefill(self, record: PrefillRecord) -> None:
        self.prefills.append(record)

    def acceptance_by_depth(self) -> list[float]:
        return [a / r if r else float("nan") for a, r in zip(self.accepted, self.reached)]

    def acceptance_by_depth_all_sources(self) -> list[float]:
        """a_k over every source's drafts (what the rows' drafted and accepted counts say); the
        per-depth counters above are the MTP heads' alone (the gamma policy's evidence)."""
        if not self.source_reached:
            return self.acceptance_by_depth()
        r = [sum(col) for col in _columns(list(self.source_reached.values()))]
        a = [sum(col) for col in _columns(list(self.source_accepted.values()))]
        return [x / y if y else float("nan") for x, y in zip(a + [0] * (len(r) - len(a)), r)]

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
            emitted_tokens=self.emitted_tokens + other.emitted_tokens,
            drafted_by_source=_add_maps(self.drafted_by_source, other.drafted_by_source),
            accepted_by_source=_add_maps(self.accepted_by_source, other.accepted_by_source),
            source_reached=_add_list_maps(self.source_reached, other.source_reached),
            source_accepted=_add_list_maps(self.source_accepted, other.source_accepted))

    def counts(self) -> "SpecStats":
        """The acceptance counters alone (no step records): a compact prior for later shards."""
        return SpecStats(list(self.reached), list(self.accepted), row_steps=self.row_steps,
                         emitted_tokens=self.emitted_tokens, drafted_by_source=dict(self.drafted_by_source),
                         accepted_by_source=dict(self.accepted_by_source),
                         source_reached={k: list(v) for k, v in self.source_reached.items()},
                         source_accepted={k: list(v) for k, v in self.source_accepted.items()})


def add_ragged_counts(reached: list[int], accepted: list[int], draft_len: list[int], num_accepted: list[int]) -> None:
    """Per-depth counts from rows with their own draft counts: draft k of a row is reached when
    the row drafted >= k and accepted >= k-1, accepted when it accepted >= k.
    Example: draft_len [3, 1], accepted [1, 1] add reached [2, 1, 0] and accepted [2, 0, 0]."""
    for g, a in zip(draft_len, num_accepted):
        if g > len(reached):
            grow = g - len(reached)
            reached += [0] * grow
            accepted += [0] * grow
        for k in range(min(a + 1, g)):
            reached[k] += 1
        for k in range(a):
            accepted[k] += 1


def _add_maps(a: dict, b: dict) -> dict:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


def _add_list_maps(a: dict, b: dict) -> dict:
    out = {}
    for k in {**a, **b}:
        x, y = a.get(k, []), b.get(k, [])
        n = max(len(x), len(y))
        out[k] = [(x[i] if i < len(x) else 0) + (y[i] if i < len(y) else 0) for i in range(n)]
    return out


def _columns(lists: list[list[int]]) -> list[list[int]]:
    """Per-depth columns of count lists of any lengths. [[1, 2], [3]] -> [[1, 3], [2, 0]]."""
    n = max((len(x) for x in lists), default=0)
    return [[x[i] if i < len(x) else 0 for x in lists] for i in range(n)]
