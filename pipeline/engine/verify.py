"""The verify forward with a number of drafts per row: padded, split or packed.

Padded: every row verifies its last token + G slots ([n, G + 1], cache reads are views); a row
with fewer drafts computes padding it throws away. Split: rows without drafts and rows with
drafts in two forwards ([n0, 1] and [n1, G + 1]). Packed: only the real tokens, one query token
per forward row ([T, 1], T = sum(draft_len + 1)), each reading its own cache row by position, so
every token gathers its row's cache. All need no change to the model (pipeline.model.cache's
Batch already takes per-row positions and cache rows), and return hidden states and logits in
the padded layout [n, G + 1, ...] (zeros at padding), which acceptance and the MTP fill read.
"""
from __future__ import annotations

import torch

from pipeline.model import native
from pipeline.model.cache import Batch
from pipeline.spec_decode.acceptance import greedy_accept

PACK_SHARE = 0.3      # layout "auto": pack when real tokens are at most this share of the padded ones (CPU)


def choose_layout(draft_len: torch.Tensor, width: int, layout: str) -> str:
    """"padded", "split" or "packed". auto: packed where at most PACK_SHARE of the padded
    tokens are real (a few rows drafting), else padded; split only when asked.
    Example: draft_len [4, 0, 0, 0], width 4: 8 real of 20 padded (0.4) -> padded;
    draft_len [4] + [0] * 9: 14 of 50 (0.28) -> packed."""
    if layout != "auto":
        return layout
    return "packed" if packs(int(draft_len.sum()), draft_len.shape[0], width) else "padded"


def packs(drafts: int, n: int, width: int) -> bool:
    """Whether `auto` packs a verify of `drafts` drafts over `n` rows at most `width` each."""
    return width > 0 and drafts + n <= PACK_SHARE * n * (width + 1)


def uniform_verify(target, cache, last_token: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor):
    """Every row verifies its last token and all G drafts (a gamma's step, or a plain one at
    G = 0): last_token [n], drafts [n, G], lengths [n] cache lengths. Returns (hidden
    [n, G + 1, H], logits [n, G + 1, V], positions [n, G + 1]). A greedy step takes
    `greedy_verify`, its forward the same."""
    hidden, positions = _uniform_forward(target, cache, last_token, drafts, lengths)
    return hidden, target.logits(hidden), positions


def greedy_verify(target, cache, last_token: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor):
    """`uniform_verify` of a greedy step with its acceptance (`greedy_accept` over the C
    argmax): returns (hidden [n, G + 1, H], num_accepted [n], emitted [n, G + 1]). Where the
    target's output linear is on the C GEMM, its logits, argmax and acceptance are one call
    (native.greedy_head: a dozen small torch calls fewer a step, each slow after the forward has
    streamed the weights through the caches). The engine's greedy steps and its cost profile
    (pipeline.engine.profile) both verify through it, so the profile times what a step runs."""
    hidden, _ = _uniform_forward(target, cache, last_token, drafts, lengths)
    got = native.greedy_head(target.output_linear(), hidden, drafts)
    if got is None:
        got = greedy_accept(drafts, target.logits(hidden), native.argmax)
    return hidden, got[0], got[1]


def _uniform_forward(target, cache, last_token: torch.Tensor, drafts: torch.Tensor, lengths: torch.Tensor):
    positions = lengths[:, None] + torch.arange(drafts.shape[1] + 1, device=lengths.device)
    tokens = torch.cat([last_token[:, None], drafts], dim=1)
    return target(tokens, Batch.make(positions), cache), positions


def verify_forward(target, cache, last_token: torch.Tensor, drafts: torch.Tensor, draft_len: torch.Tensor,
                   lengths: torch.Tensor, layout: str = "auto"):
    """last_token [n], drafts [n, G] (PAD beyond draft_len), lengths [n] cache lengths.
    Returns (hidden [n, G + 1, H], logits [n, G + 1, V], tokens computed). Logits are computed
    at the real positions only (the output projection is a large share of a small model)."""
    n, g = drafts.shape
    dev = drafts.device
    tokens = torch.cat([last_token[:, None], drafts.clamp(min=0)], dim=1)          # [n, G + 1]
    kind = choose_layout(draft_len, g, layout)
    if kind == "padded":
        positions = lengths[:, None] + torch.arange(g + 1, device=dev)
        hidden = target(tokens, Batch.make(positions), cache)                       # [n, G + 1, H]
        return hidden, _real_logits(target, hidden, draft_len), n * (g + 1)
    if kind == "split":
        return _split(target, cache, tokens, draft_len, lengths)
    return _packed(target, cache, tokens, draft_len, lengths)


def _real_logits(target, hidden: torch.Tensor, draft_len: torch.Tensor) -> torch.Tensor:
    """Logits [n, G + 1, V] at positions 0..draft_len of each row, zeros elsewhere."""
    n, q, _ = hidden.shape
    real = torch.arange(q, device=hidden.device) <= draft_len[:, None]              # [n, G + 1]
    if bool(real.all()):
        return target.logits(hidden)
    part = target.logits(hidden[real])                                              # [T, V]
    logits = part.new_zeros(n, q, part.shape[-1])
    logits[real] = part
    return logits


def _split(target, cache, tokens, draft_len, lengths):
    """Two forwards: rows without drafts ([n0, 1]) and rows with drafts ([n1, G + 1]), each
    reading its rows' caches (one gather per row, not per token)."""
    n, q = tokens.shape
    dev = tokens.device
    drafting = draft_len > 0
    hidden = None
    logits = None
    for rows, width in ((torch.nonzero(~drafting)[:, 0], 1), (torch.nonzero(drafting)[:, 0], q)):
        if rows.numel() == 0:
            continue
        positions = lengths[rows, None] + torch.arange(width, device=dev)
        h = target(tokens[rows, :width], Batch.make(positions, rows=rows), cache)   # [r, width, H]
        lg = _real_logits(target, h, draft_len[rows])
        if hidden is None:
            hidden = h.new_zeros(n, q, h.shape[-1])
            logits = lg.new_zeros(n, q, lg.shape[-1])
        hidden[rows, :width] = h
        logits[rows, :width] = lg
    return hidden, logits, int((~drafting).sum()) + int(drafting.sum()) * q


def _packed(target, cache, tokens, draft_len, lengths):
    """One query token per forward row ([T, 1]): only real tokens, but a cache gather per token."""
    n, q = tokens.shape
    dev = tokens.device
    qn = draft_len + 1                                                              # [n]
    row_of = torch.repeat_interleave(torch.arange(n, device=dev), qn)              # [T]
    start = qn.cumsum(0) - qn                                                       # [n]
    offset = torch.arange(row_of.shape[0], device=dev) - start[row_of]             # [T]
    pos = (lengths[row_of] + offset)[:, None]                                       # [T, 1]
    hidden_p = target(tokens[row_of, offset][:, None], Batch.make(pos, rows=row_of), cache)[:, 0]   # [T, H]
    logits_p = target.logits(hidden_p)                                              # [T, V]
    hidden = hidden_p.new_zeros(n, q, hidden_p.shape[-1])
    logits = logits_p.new_zeros(n, q, logits_p.shape[-1])
    hidden[row_of, offset] = hidden_p
    logits[row_of, offset] = logits_p
    return hidden, logits, int(row_of.shape[0])
