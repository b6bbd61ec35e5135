"""The verify forward with a number of drafts per row: padded or packed.

Padded: every row verifies its last token + G slots ([n, G + 1], cache reads are views); a row
with fewer drafts computes padding it throws away. Packed: only the real tokens, one query
token per "batch row" of the forward ([T, 1], T = sum(draft_len + 1)), each reading its own
cache row by position; the cache reads become gathers, so it pays where drafts are ragged
(`PACK_SHARE`). Both return hidden states and logits in the padded layout [n, G + 1, ...]
(zeros at padding), which is what acceptance and the MTP fill read.
"""
from __future__ import annotations

import torch

from pipeline.model.cache import Batch

PACK_SHARE = 0.7      # layout "auto": pack when real tokens are at most this share of the padded ones


def use_packed(draft_len: torch.Tensor, width: int, layout: str) -> bool:
    """Whether to pack. Example: draft_len [4, 0, 0, 0], width 4: 8 real of 20 padded -> packed."""
    if layout != "auto":
        return layout == "packed"
    n = draft_len.shape[0]
    return width > 0 and int(draft_len.sum()) + n <= PACK_SHARE * n * (width + 1)


def verify_forward(target, cache, last_token: torch.Tensor, drafts: torch.Tensor, draft_len: torch.Tensor,
                   lengths: torch.Tensor, layout: str = "auto"):
    """last_token [n], drafts [n, G] (PAD beyond draft_len), lengths [n] cache lengths.
    Returns (hidden [n, G + 1, H], logits [n, G + 1, V], tokens computed)."""
    n, g = drafts.shape
    dev = drafts.device
    tokens = torch.cat([last_token[:, None], drafts.clamp(min=0)], dim=1)          # [n, G + 1]
    if not use_packed(draft_len, g, layout):
        positions = lengths[:, None] + torch.arange(g + 1, device=dev)
        hidden = target(tokens, Batch.make(positions), cache)
        return hidden, target.logits(hidden), n * (g + 1)
    q = draft_len + 1                                                               # [n]
    row_of = torch.repeat_interleave(torch.arange(n, device=dev), q)               # [T]
    start = q.cumsum(0) - q                                                         # [n]
    offset = torch.arange(row_of.shape[0], device=dev) - start[row_of]             # [T]
    pos = (lengths[row_of] + offset)[:, None]                                       # [T, 1]
    hidden_p = target(tokens[row_of, offset][:, None], Batch.make(pos, rows=row_of), cache)[:, 0]   # [T, H]
    logits_p = target.logits(hidden_p)                                              # [T, V]
    hidden = hidden_p.new_zeros(n, g + 1, hidden_p.shape[-1])
    logits = logits_p.new_zeros(n, g + 1, logits_p.shape[-1])
    hidden[row_of, offset] = hidden_p
    logits[row_of, offset] = logits_p
    return hidden, logits, int(row_of.shape[0])
