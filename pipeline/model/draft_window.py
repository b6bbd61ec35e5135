"""A checkpoint's MTP prompt window: how many of each prompt's last tokens its heads read.

The heads' fill of a prompt is work only drafting pays (one layer over the prompt, against the
target's L), and a small head may draft as well or better from the recent tokens alone. Whether
it does is a property of the heads, so it is measured per checkpoint
(`benchmarks/draft_window.py`) and stored beside them as `draft_window.json`:

    {"format": 1, "prompt_tokens": 64, "rule": "...", "measured": {"64": {"json": 3.07, ...}, ...}}

The engine reads it at load (`Engine.draft_window`; `spec.draft_window` overrides it). Without the
file, the heads read whole prompts. The window never changes the text: drafts only propose.
"""
from __future__ import annotations

import json
from pathlib import Path

FILE = "draft_window.json"
KEEP = 0.98      # a window is kept when every task's tokens per step stay at least this share of the whole prompt's


def read_draft_window(path) -> int:
    """The prompt window stored with checkpoint directory `path` (0: whole prompts, also when
    there is no file or it cannot be read)."""
    try:
        body = json.loads((Path(path) / FILE).read_text())
        tokens = int(body["prompt_tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return max(tokens, 0)


def choose_window(measured: dict[int, dict[str, float]], keep: float = KEEP) -> int:
    """The smallest window whose tokens per verify step are at least `keep` x the whole prompt's
    (window 0) on every task, or 0. `measured`: window -> task -> mean tokens per step.
    Example: {0: {"a": 3.0}, 32: {"a": 2.8}, 64: {"a": 2.98}} -> 64 (32 keeps 0.93)."""
    whole = measured[0]
    fits = [w for w, by_task in measured.items()
            if w > 0 and all(by_task[t] >= keep * whole[t] for t in whole)]
    return min(fits) if fits else 0


def write_draft_window(path, tokens: int, measured: dict[int, dict[str, float]], source: str) -> Path:
    """Store the chosen window and the measurements it came from; returns the file written."""
    body = {"format": 1, "prompt_tokens": int(tokens),
            "rule": f"the smallest window keeping >= {KEEP} x the whole prompt's tokens per step on every task",
            "source": source,
            "measured": {str(w): {t: round(v, 3) for t, v in by_task.items()} for w, by_task in sorted(measured.items())}}
    out = Path(path) / FILE
    out.write_text(json.dumps(body, indent=1) + "\n")
    return out
