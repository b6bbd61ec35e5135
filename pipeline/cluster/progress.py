"""The driver's progress bar: rows done of total, output tokens/s, mean acceptance length,
and the gamma in use per task."""
from __future__ import annotations

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, initial: int, enabled: bool = True) -> None:
        self.bar = tqdm(total=total, initial=initial, unit="row", desc="generate",
                        dynamic_ncols=True, disable=not enabled)
        self.gamma_by_task: dict[str, object] = {}

    def update(self, rows: int, stats_rows: list[dict], totals: dict) -> None:
        for r in stats_rows:
            self.gamma_by_task[r["task"]] = "?" if r.get("gamma") is None else r["gamma"]
        tok_s = totals.get("tokens_per_s")
        acc = totals.get("mean_acceptance_length")
        gammas = " ".join(f"{t}={g}" for t, g in sorted(self.gamma_by_task.items()))
        self.bar.set_postfix_str(
            f"{tok_s or 0:.1f} tok/s, acc len {acc or 0:.2f}, gamma {gammas}", refresh=False)
        self.bar.update(rows)

    def close(self) -> None:
        self.bar.close()
