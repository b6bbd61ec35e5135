"""Acceptance with a number of drafts per row (`draft_len`) and deterministic drafts.

Rows of one verify step may carry different numbers of drafts: drafts [n, G] is padded with -1
beyond each row's `draft_len`, and a padded slot is never accepted. A deterministic draft source
(n-gram lookup) proposes d with q = one-hot(d), so the rejection rule becomes: accept with
probability p(d); on rejection sample the residual max(0, p - q) = p with d removed. Such rows
are marked `one_hot` and need no [V]-sized q at all.
"""
from __future__ import annotations

import torch

from pipeline.spec_decode.acceptance import accepted_prefix
from pipeline.spec_decode.sampling import sample

PAD = -1          # a padded draft slot: never matches a target token


def pad_mask(draft_len: torch.Tensor, width: int) -> torch.Tensor:
    """[n] lengths -> [n, width] True where a real draft sits. [2, 0] width 3 -> [[1,1,0],[0,0,0]]."""
    return torch.arange(width, device=draft_len.device) < draft_len[:, None]


def rejection_sample_ragged(drafts: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                            u_accept: torch.Tensor, u_final: torch.Tensor, draft_len: torch.Tensor,
                            one_hot: torch.Tensor | None = None):
    """Lossless speculative sampling with per-row draft counts and one-hot rows.

    drafts: [n, G] (PAD beyond draft_len); draft_probs q: [n, G, V] or None (every row one-hot);
    target_probs p: [n, G + 1, V]; u_accept: [n, G]; u_final: [n, G + 1]; draft_len: [n];
    one_hot: [n] bool, rows whose drafts are deterministic (their q rows are ignored).
    Returns (num_accepted [n], emitted [n, G + 1]) as `rejection_sample` does; num_accepted[i]
    <= draft_len[i], and when it equals draft_len[i] the bonus token comes from p.
    Example: one row, draft d=3 with p(3) = 0.25, u_accept = 0.5: rejected (0.5 >= 0.25), and the
    recovered token is sampled from p with p(3) set to 0, renormalised.
    """
    n, g = drafts.shape
    real = pad_mask(draft_len, g)                                             # [n, G]
    safe = drafts.clamp(min=0)
    p_d = target_probs[:, :g].gather(-1, safe[..., None]).squeeze(-1)         # [n, G]
    if one_hot is None:
        one_hot = torch.full((n,), draft_probs is None, dtype=torch.bool, device=drafts.device)
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = torch.where(one_hot[:, None], 1.0, draft_probs.gather(-1, safe[..., None]).squeeze(-1))
    accept = (u_accept * q_d < p_d) & real
    num_accepted = accepted_prefix(accept)
    rows = torch.arange(n, device=drafts.device)
    p_at = target_probs[rows, num_accepted]                                   # [n, V]
    rejected = num_accepted < draft_len                                       # else: bonus token from p
    residual = p_at.clone()
    if draft_probs is not None:
        q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
        use_q = (rejected & ~one_hot)[:, None]
        residual = torch.where(use_q, (p_at - q_pad[rows, num_accepted]).clamp(min=0), residual)
    at = torch.cat([safe, safe[:, :1]], dim=1)[rows, num_accepted]           # [n] draft at the rejection
    drop = rejected & one_hot
    residual[rows[drop], at[drop]] = 0.0                                      # p with d removed
    empty = residual.sum(-1, keepdim=True) <= 0       # p == q up to rounding: fall back to p
    residual = torch.where(empty, p_at, residual)
    final = sample(residual, u_final[rows, num_accepted])
    emitted = torch.cat([safe, safe[:, :1]], dim=1)
    emitted[rows, num_accepted] = final
    return num_accepted, emitted
