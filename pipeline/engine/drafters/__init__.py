"""Draft sources behind one protocol (base.DraftSource): `mtp` (the checkpoint's heads) and
`ngram` (suffix matches in the row and the task's recent outputs). `make_sources` builds those
a checkpoint has (for a generate call, a profile or a benchmark); `Sources` holds them, fans
the slot events (reset, move, drop, finish) out to each and sums their deferred work."""
from __future__ import annotations

from pipeline.engine.drafters.base import DraftRequest, DraftSource, Proposal
from pipeline.engine.params import DRAFT_CHOICES
from pipeline.engine.drafters.mtp import MTPSource
from pipeline.engine.drafters.ngram import NgramSource
from pipeline.engine.drafters.task_index import TaskIndex

__all__ = ["DRAFT_CHOICES", "DraftRequest", "DraftSource", "MTPSource", "NgramSource", "Proposal", "Sources",
           "TaskIndex", "make_sources", "resolve_draft"]


def resolve_draft(draft: str, has_heads: bool) -> tuple[str, ...]:
    """The sources a call may use. auto: every source the checkpoint has; mtp without heads is
    an error. Example: ("auto", False) -> ("ngram",); ("auto", True) -> ("mtp", "ngram")."""
    if draft not in DRAFT_CHOICES:
        raise ValueError(f"draft must be one of {', '.join(DRAFT_CHOICES)}, got {draft!r}")
    if draft == "none":
        return ()
    if draft == "mtp":
        if not has_heads:
            raise ValueError("draft='mtp' needs MTP heads; this checkpoint has none (use draft='ngram')")
        return ("mtp",)
    if draft == "ngram":
        return ("ngram",)
    return ("mtp", "ngram") if has_heads else ("ngram",)


def make_sources(engine, names, rows: int, capacity: int, task_index: TaskIndex | None = None,
                 coupled: bool = False, held_cache: bool = False) -> Sources | None:
    """The sources of `names` that `engine` has, for `rows` slots of `capacity` tokens (None: none).
    `task_index`: the n-gram source's task outputs; `coupled`, `held_cache`: MTPSource.for_engine."""
    found: dict[str, DraftSource] = {}
    if "mtp" in names and engine.heads:
        found["mtp"] = MTPSource.for_engine(engine, rows, capacity, coupled, held_cache)
    if "ngram" in names:
        found["ngram"] = NgramSource(task_index, engine.device)
    return Sources(found) if found else None


class Sources:
    """The draft sources of one generate call, by name (what Slots calls `drafter`)."""

    def __init__(self, sources: dict[str, DraftSource]):
        self.by_name = sources

    def get(self, name: str):
        return self.by_name.get(name)

    def __iter__(self):
        return iter(self.by_name.values())

    def reset_rows(self, rows) -> None:
        for s in self:
            s.reset_rows(rows)

    def move_row(self, src: int, dst: int) -> None:
        for s in self:
            s.move_row(src, dst)

    def drop_rows(self, rows) -> None:
        for s in self:
            s.drop_rows(rows)

    def finish_rows(self, rows) -> None:
        for s in self:
            s.finish_rows(rows)

    def waiting_tokens(self) -> dict[int, int]:
        """Per slot, the tokens every source's deferred work holds (base: deferred work)."""
        out: dict[int, int] = {}
        for s in self:
            for slot, k in s.waiting_tokens().items():
                out[slot] = out.get(slot, 0) + k
        return out

    def take_prompt_fill(self) -> tuple[float, int]:
        """(seconds, tokens) of the deferred prefill work the sources ran since the last take."""
        seconds, tokens = 0.0, 0
        for s in self:
            f_s, f_t = s.take_prompt_fill()
            seconds, tokens = seconds + f_s, tokens + f_t
        return seconds, tokens
