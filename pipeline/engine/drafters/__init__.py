"""Draft sources behind one protocol (base.DraftSource): `mtp` (the checkpoint's heads) and
`ngram` (suffix matches in the row and the task's recent outputs). `Sources` holds those a
generate call uses and fans the slot events (reset, move, drop, finish) out to each."""
from __future__ import annotations

from pipeline.engine.drafters.base import DraftRequest, DraftSource, Proposal
from pipeline.engine.params import DRAFT_CHOICES
from pipeline.engine.drafters.mtp import MTPSource
from pipeline.engine.drafters.ngram import NgramSource
from pipeline.engine.drafters.task_index import TaskIndex

__all__ = ["DRAFT_CHOICES", "DraftRequest", "DraftSource", "MTPSource", "NgramSource", "Proposal", "Sources",
           "TaskIndex", "resolve_draft"]


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
