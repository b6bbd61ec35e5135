"""The acceptance rule of speculative decoding: greedy, coupled and rejection sampling.

Terms (DESIGN.md): of the gamma drafts of a row, the *accepted tokens* are the longest prefix the
target keeps. Then one target token is emitted: the *recovered token* at the first rejected
position, or the *bonus token* after all gamma drafts were accepted. So each verify step emits
accepted + 1 tokens per row (the acceptance length, 1..gamma+1).
Greedy and coupled verification keep a draft exactly when it equals the target's own token at its
position (`coupled_accept`); rejection verification keeps it with probability min(1, p/q).
"""
from __future__ import annotations

import torch

from pipeline.spec_decode.sampling import argmax_last, sample


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """[n, gamma] bool -> [n] int64 length of the all-True prefix. [[1,1,0,1]] -> [2]."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def coupled_accept(drafts: torch.Tensor, target_tokens: torch.Tensor):
    """Keep the drafts that equal the target's tokens, up to the first that does not.

    drafts: [n, gamma] (a padded slot holds -1, which no token equals, so a row with fewer
    drafts stops there); target_tokens: [n, gamma + 1], the target's token at each position
    (argmax when greedy, coupled_sample when sampling). Returns (num_accepted [n], emitted
    [n, gamma + 1]) where row i emits emitted[i, :num_accepted[i] + 1]: the target's tokens, which
    equal the accepted drafts on the accepted prefix, so the output is what the target alone
    would have produced with the same noise, whatever the drafts were.
    Example: drafts [[5, 7], [5, -1]], target [[5, 9, 4], [5, 6, 2]] -> num_accepted [1, 1],
    emitted = target (row 0 emits 5, 9; row 1 emits 5, 6).
    """
    if drafts.shape[1] == 0:                 # plain decoding: nothing to compare (saves a few ops per step)
        return torch.zeros(drafts.shape[0], dtype=torch.long, device=target_tokens.device), target_tokens
    return accepted_prefix(drafts == target_tokens[:, :-1]), target_tokens


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor, argmax=argmax_last):
    """Greedy verification.

    drafts: [n, gamma]; target_logits: [n, gamma + 1, V]; `argmax`: torch.argmax's rule over the
    last dimension (the engine passes its C one on CPU, pipeline.model.native.argmax).
    Returns (num_accepted [n], emitted [n, gamma + 1]) where row i emits emitted[i, :num_accepted[i] + 1]:
    the target's argmax at every position, which equals the accepted drafts on the accepted prefix.
    Example: drafts [[5, 7]], argmax [[5, 9, 4]] -> num_accepted [1], emitted row [5, 9, 4] (emit 5, 9).
    """
    return coupled_accept(drafts, argmax(target_logits))               # target: [n, gamma + 1]


def rejection_sample(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     u_accept: torch.Tensor, u_final: torch.Tensor):
    """Lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    Draft k is accepted with probability min(1, p(d)/q(d)). At the first rejection the recovered
    token is sampled from the normalised residual max(0, p - q); after all gamma acceptances the
    bonus token is sampled from p at position gamma + 1. The emitted tokens follow p exactly.

    drafts: [n, gamma]; draft_probs q: [n, gamma, V]; target_probs p: [n, gamma + 1, V];
    u_accept: [n, gamma] and u_final: [n, gamma + 1] uniforms in [0, 1); u_final[i, j] samples the
    recovered or bonus token when row i accepts j drafts.
    Returns (num_accepted [n], emitted [n, gamma + 1]): row i emits emitted[i, :num_accepted[i] + 1],
    i.e. its accepted drafts and then the recovered or bonus token. Every row carries all gamma
    drafts with a full q: `rejection_sample_ragged` is the general form.
    """
    draft_len = torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long, device=drafts.device)
    return rejection_sample_ragged(drafts, draft_probs, target_probs, u_accept, u_final, draft_len)


# ---- per-row draft counts and deterministic drafts ----------------------------------------------
# Rows of one verify step may carry different numbers of drafts: drafts [n, G] is padded with -1
# beyond each row's `draft_len`, and a padded slot is never accepted. A deterministic draft source
# (n-gram lookup) proposes d with q = one-hot(d), so the rejection rule becomes: accept with
# probability p(d); on rejection sample the residual max(0, p - q) = p with d removed. Such rows
# are marked `one_hot` and need no [V]-sized q at all.

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
    one_hot: [n] bool, rows whose drafts are deterministic (their q rows are ignored), or [n, G]
    bool per draft (a row whose heads' drafts carry q and whose n-gram tail does not).
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
    if one_hot.dim() == 1:
        one_hot = one_hot[:, None].expand(n, g)                               # [n, G] per draft
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = torch.where(one_hot, 1.0, draft_probs.gather(-1, safe[..., None]).squeeze(-1))
    accept = (u_accept * q_d < p_d) & real
    num_accepted = accepted_prefix(accept)
    rows = torch.arange(n, device=drafts.device)
    p_at = target_probs[rows, num_accepted]                                   # [n, V]
    rejected = num_accepted < draft_len                                       # else: bonus token from p
    one_hot_at = torch.cat([one_hot, one_hot[:, :1]], dim=1)[rows, num_accepted]   # [n] the rejected draft's
    residual = p_at.clone()
    if draft_probs is not None:
        q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
        use_q = (rejected & ~one_hot_at)[:, None]
        residual = torch.where(use_q, (p_at - q_pad[rows, num_accepted]).clamp(min=0), residual)
    at = torch.cat([safe, safe[:, :1]], dim=1)[rows, num_accepted]           # [n] draft at the rejection
    drop = rejected & one_hot_at
    residual[rows[drop], at[drop]] = 0.0                                      # p with d removed
    empty = residual.sum(-1, keepdim=True) <= 0       # p == q up to rounding: fall back to p
    residual = torch.where(empty, p_at, residual)
    final = sample(residual, u_final[rows, num_accepted])
    emitted = torch.cat([safe, safe[:, :1]], dim=1)
    emitted[rows, num_accepted] = final
    return num_accepted, emitted
