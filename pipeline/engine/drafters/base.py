"""The drafter protocol: what the engine asks of a draft source, and what it gets back.

A source proposes up to `max_len` drafts for each active row (`propose`), hears what the target
kept (`after_prefill`, `after_verify`), is told when it sat a step out (`skip`), and follows the
slots as rows move, reset or finish. The engine never asks which source it is; adding one is a
file in this folder and a line in `pipeline.engine.drafters.make_sources`.

Each source also reports its own cost, for the cost model (pipeline.spec_decode.cost):
`cost_per` says what it grows with ("depth": device work per draft depth for every row, timed
with the step's drafting, e.g. the heads; "row": host work per row whatever the depth, which the
source times itself into `Proposal.seconds`, e.g. the n-gram lookup), and `probe` hands out one
made-up proposal to time, so a profile or benchmark measures a source without a generate call.

A source may defer work to its next proposal (the heads run a row's prompt, and the tokens of
steps they sat out, before drafting for it). It tells how much waits (`waiting_tokens`, per
slot: the gamma policy prices it), hands over the seconds of the part that was prefill work
(`take_prompt_fill`), and says what its last proposal ran over the previous step
(`last_fill_tokens`, -1 where it has no such fill). A source that defers nothing returns
{}, (0.0, 0) and -1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch


@dataclass
class DraftRequest:
    n: int                        # active rows 0..n-1
    lengths: torch.Tensor         # [n] target cache lengths
    max_len: int                  # drafts per row at most
    pick: Callable                # pick(logits [n, V], depth) -> (tokens [n], probs [n, V] or None)
    rows: list                    # [n] the Row objects (host-side tokens of each row)


@dataclass
class Proposal:
    drafts: torch.Tensor              # [n, G] int64, PAD (-1) beyond each row's draft_len
    draft_len: torch.Tensor           # [n] drafts of each row (0..G)
    probs: torch.Tensor | None        # [n, G, V] q of each draft; None: deterministic (one-hot q)
    match: list[int] | None = None    # [n] per row: how the draft was found (n-gram: match length)
    seconds: float = 0.0              # host time the source measured proposing ("row" sources)
    host_len: list[int] | None = None # draft_len on the host, where the source has it (no device read)


class DraftSource(Protocol):
    name: str                     # "mtp", "ngram": the stats' key
    deterministic: bool           # proposals are one-hot in q (no probs)
    needs_hidden: bool            # after_verify needs the target's hidden states
    cost_per: str                 # "depth" (device, per draft depth) or "row" (host, per row)

    def propose(self, req: DraftRequest) -> Proposal: ...
    def probe(self, rows: int, depth: int, ctx: int) -> Callable[[], object]: ...
    def after_prefill(self, slots: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor,
                      lens: torch.Tensor, first: torch.Tensor) -> None: ...
    def after_verify(self, n: int, lengths: torch.Tensor, hidden: torch.Tensor, emitted: torch.Tensor,
                     num_accepted: torch.Tensor, accepted: list[int]) -> None: ...   # accepted: num_accepted on the host
    def skip(self) -> None: ...
    def reset_rows(self, rows: torch.Tensor) -> None: ...
    def move_row(self, src: int, dst: int) -> None: ...
    def drop_rows(self, rows: torch.Tensor) -> None: ...
    def finish_rows(self, rows: list) -> None: ...
    def waiting_tokens(self) -> dict[int, int]: ...          # slot -> tokens its deferred work holds
    def take_prompt_fill(self) -> tuple[float, int]: ...     # (seconds, tokens) of deferred prefill work run
    def last_fill_tokens(self) -> int: ...                   # tokens the last proposal ran over the last step
