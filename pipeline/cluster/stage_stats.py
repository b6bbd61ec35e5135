"""Speculation stats of one Ray Data stage actor (pipeline.ray_data), over every batch it ran.

The same quantities as a shard's stats row (DESIGN.md "Run directory"), accumulated per actor
instead of per shard: per-depth acceptance a_k = accepted[k] / reached[k] (as in
pipeline.spec_decode.stats, whose counters are added here), verify steps per gamma, tokens/s
over the time spent in `engine.generate`. Plain ints and floats (no torch), so the driver can
unpickle and merge them; `merge` adds two actors' stats, `summary` is what
`Processor.stats()` returns.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence


@dataclass
class StageStats:
    batches: int = 0
    rows: int = 0
    errors: int = 0                       # rows whose `error` is set
    generated_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    generate_time_s: float = 0.0          # wall time inside engine.generate (profiling included)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    host_time_s: float = 0.0              # the steps' time outside draft and verify (StepRecord.overhead_s)
    gamma_steps: dict[int, int] = field(default_factory=dict)   # gamma -> verify steps
    reached: list[int] = field(default_factory=list)     # by depth k-1 (SpecStats.reached)
    accepted: list[int] = field(default_factory=list)    # by depth k-1 (SpecStats.accepted)
    row_steps: int = 0
    emitted_tokens: int = 0               # accepted + 1 per row per verify step

    def observe_call(self, spec: Any, wall_s: float) -> None:
        """One engine.generate call: `spec` is its SpecStats (engine.last_stats)."""
        self.generate_time_s += wall_s
        steps = list(getattr(spec, "steps", []) or [])
        self.draft_time_s += sum(float(getattr(s, "draft_s", 0.0)) for s in steps)
        self.verify_time_s += sum(float(getattr(s, "verify_s", 0.0)) for s in steps)
        self.host_time_s += sum(float(getattr(s, "overhead_s", 0.0)) for s in steps)
        for gamma, n in Counter(int(s.gamma) for s in steps if hasattr(s, "gamma")).items():
            self.gamma_steps[gamma] = self.gamma_steps.get(gamma, 0) + n
        self._add_counts(list(getattr(spec, "reached", []) or []),
                         list(getattr(spec, "accepted", []) or []))
        self.row_steps += int(getattr(spec, "row_steps", 0) or 0)
        self.emitted_tokens += int(getattr(spec, "emitted_tokens", 0) or 0)

    def observe_rows(self, results: Sequence[dict]) -> None:
        """One batch's output rows (the per-row fields of pipeline.cluster.worker.output_result)."""
        self.batches += 1
        self.rows += len(results)
        self.errors += sum(1 for r in results if r.get("error") is not None)
        self.generated_tokens += sum(int(r.get("num_generated_tokens") or 0) for r in results)
        self.drafted_tokens += sum(int(r.get("num_drafted_tokens") or 0) for r in results)
        self.accepted_tokens += sum(int(r.get("num_accepted_tokens") or 0) for r in results)

    def _add_counts(self, reached: list[int], accepted: list[int]) -> None:
        depth = max(len(self.reached), len(reached))
        self.reached = [a + b for a, b in zip(_pad(self.reached, depth), _pad(reached, depth))]
        self.accepted = [a + b for a, b in zip(_pad(self.accepted, depth), _pad(accepted, depth))]

    def merge(self, other: "StageStats") -> "StageStats":
        out = StageStats(**{k: getattr(self, k) + getattr(other, k) for k in _SUMMED})
        out.gamma_steps = dict(Counter(self.gamma_steps) + Counter(other.gamma_steps))
        out._add_counts(self.reached, self.accepted)
        out._add_counts(other.reached, other.accepted)
        return out

    def summary(self) -> dict:
        """acceptance_by_depth: a_k (None where depth k was never reached);
        mean_acceptance_length: tokens per verify step per row, the recovered/bonus token
        included; tokens_per_s: generated tokens / generate_time_s."""
        return {
            "batches": self.batches, "num_rows": self.rows, "num_errors": self.errors,
            "num_generated_tokens": self.generated_tokens,
            "num_drafted_tokens": self.drafted_tokens, "num_accepted_tokens": self.accepted_tokens,
            "tokens_per_s": self.generated_tokens / self.generate_time_s if self.generate_time_s > 0 else None,
            "acceptance_by_depth": [a / r if r else None for a, r in zip(self.accepted, self.reached)],
            "mean_acceptance_length": self.emitted_tokens / self.row_steps if self.row_steps else None,
            "gamma_steps": dict(sorted(self.gamma_steps.items())),
            "generate_time_s": self.generate_time_s, "draft_time_s": self.draft_time_s,
            "verify_time_s": self.verify_time_s, "host_time_s": self.host_time_s,
        }


_SUMMED = ("batches", "rows", "errors", "generated_tokens", "drafted_tokens", "accepted_tokens",
           "generate_time_s", "draft_time_s", "verify_time_s", "host_time_s", "row_steps", "emitted_tokens")


def _pad(xs: list[int], depth: int) -> list[int]:
    return list(xs) + [0] * (depth - len(xs))
