"""Refuse to resume a run whose checkpoint or dataset changed since it started.

The manifest records both inputs' fingerprints (fingerprint.py); a resume compares them with
the inputs as they are now. Rows generated from other weights, or from other input rows,
would make one run of two, so a difference is a UserError naming each changed file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import UserError
from pipeline.data.fingerprint import describe_changes

_WHAT = {"checkpoint": ("model.path", "checkpoint"), "dataset": ("data.path", "dataset")}


def input_changes(before: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """Differences between the recorded fingerprints and today's. An input either side could
    not fingerprint (None: a model URI, an old manifest) is not compared."""
    changes: list[str] = []
    for kind, (key, label) in _WHAT.items():
        old, new = (before or {}).get(kind), now.get(kind)
        if old is None or new is None:
            continue
        changes += [f"{key}: {c}" for c in describe_changes(label, old, new)]
    return changes


def check_same_inputs(before: dict[str, Any] | None, now: dict[str, Any], run_dir: Path | str) -> None:
    changes = input_changes(before, now)
    if changes:
        shown = "; ".join(changes[:10]) + (f"; and {len(changes) - 10} more" if len(changes) > 10 else "")
        raise UserError(f"resume=true but the inputs changed since the run in {run_dir} started: "
                        f"{shown}. Resume with the original inputs, choose another output.dir, "
                        "or pass overwrite=true (instead of resume=true) to delete that run and "
                        "start over")
