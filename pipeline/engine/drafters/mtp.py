"""The MTP heads as a draft source: the chained heads of pipeline.engine.drafter behind the
drafter protocol. Every row drafts the same number of tokens (the heads run for all rows)."""
from __future__ import annotations

import torch

from pipeline.engine.drafter import Drafter, PendingFill
from pipeline.engine.drafters.base import DraftRequest, Proposal


class MTPSource:
    name = "mtp"
    deterministic = False
    needs_hidden = True

    def __init__(self, drafter: Drafter):
        self.drafter = drafter

    def propose(self, req: DraftRequest) -> Proposal:
        drafts, probs = self.drafter.propose(req.n, req.lengths, req.max_len, req.pick)   # [n, g]
        draft_len = torch.full((req.n,), req.max_len, dtype=torch.long, device=drafts.device)
        return Proposal(drafts, draft_len, probs)

    def after_prefill(self, slots, hidden, ids, lens, first) -> None:
        idx = torch.arange(len(lens), device=lens.device)
        next_ids = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        next_ids[idx, lens - 1] = first
        self.drafter.add_pending(PendingFill(slots, torch.zeros_like(lens), hidden, next_ids, lens, from_zero=True))

    def after_verify(self, n, lengths, hidden, emitted, num_accepted) -> None:
        self.drafter.add_pending(PendingFill(torch.arange(n, device=lengths.device), lengths.clone(),
                                             hidden, emitted, num_accepted + 1))

    def skip(self) -> None:
        self.drafter.discard_pending()

    def reset_rows(self, rows) -> None:
        self.drafter.reset_rows(rows)

    def move_row(self, src: int, dst: int) -> None:
        self.drafter.move_row(src, dst)

    def drop_rows(self, rows) -> None:
        self.drafter.drop_rows(rows)

    def finish_rows(self, rows) -> None:
        pass
