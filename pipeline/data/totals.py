"""Run totals kept as running sums, so the driver holds a few numbers, not every shard's row.

`RunTotals.observe(stats_rows)` folds one committed shard in; `to_dict` gives the manifest's
`totals`. Memory and time per shard are constant: the per-shard detail (cost samples,
acceptance by depth) stays in that shard's stats file (stats_files.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable


@dataclass
class RunTotals:
    rows: int = 0
    rows_with_error: int = 0
    generated_tokens: int = 0
    steps: float = 0.0                  # verify steps: generated tokens / mean acceptance length
    gamma_steps: Counter = field(default_factory=Counter)  # gamma -> verify steps

    def observe(self, stats_rows: Iterable[dict]) -> None:
        for r in stats_rows:
            generated = r.get("num_generated_tokens") or 0
            self.rows += r["num_rows"]
            self.rows_with_error += r.get("num_errors") or 0
            self.generated_tokens += generated
            if r.get("mean_acceptance_length"):
                self.steps += generated / r["mean_acceptance_length"]
            for g, n in enumerate(r.get("gamma_steps") or ()):
                if n:
                    self.gamma_steps[g] += n

    def to_dict(self, session_tokens: int = 0, session_wall_s: float = 0.0) -> dict[str, Any]:
        """mean_acceptance_length is emitted tokens over verify steps, pooled across shards;
        tokens_per_s is this driver session's throughput (a resume counts only its own)."""
        return {
            "rows": self.rows,
            "rows_with_error": self.rows_with_error,
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": session_tokens / session_wall_s if session_wall_s > 0 else None,
            "mean_acceptance_length": self.generated_tokens / self.steps if self.steps > 0 else None,
            "gamma_histogram": {str(g): n for g, n in sorted(self.gamma_steps.items())},  # gamma -> verify steps
        }
