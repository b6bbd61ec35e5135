"""The acceptance rule of speculative decoding, greedy and lossless-sampling.

Terms (DESIGN.md): of the gamma drafts of a row, the *accepted tokens* are the longest prefix the
target keeps. Then one target token is emitted: the *recovered token* at the first rejected
position, or the *bonus token* after all gamma drafts were accepted. So each verify step emits
accepted + 1 tokens per row (the acceptance length, 1..gamma+1).
"""
from __future__ import annotations

import torch

from pipeline.spec_decode.sampling import sample


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """[n, gamma] bool -> [n] int64 length of the all-True prefix. [[1,1,0,1]] -> [2]."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor):
    """Greedy verification.

    drafts: [n, gamma]; target_logits: [n, gamma + 1, V].
    Returns (num_accepted [n], emitted [n, gamma + 1]) where row i emits emitted[i, :num_accepted[i] + 1]:
    the target's argmax at every position, which equals the accepted drafts on the accepted prefix.
    Example: drafts [[5, 7]], argmax [[5, 9, 4]] -> num_accepted [1], emitted row [5, 9, 4] (emit 5, 9).
    """
    target = target_logits.argmax(dim=-1)                                # [n, gamma + 1]
    if drafts.shape[1] == 0:                 # plain decoding: nothing to compare (saves a few ops per step)
        return torch.zeros(drafts.shape[0], dtype=torch.long, device=target.device), target
    num_accepted = accepted_prefix(drafts == target[:, :-1])
    return num_accepted, target


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
    i.e. its accepted drafts and then the recovered or bonus token.
    """
    n, gamma = drafts.shape
    p_d = target_probs[:, :gamma].gather(-1, drafts[..., None]).squeeze(-1)   # [n, gamma]
    q_d = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)               # [n, gamma]
    accept = u_accept * q_d < p_d                     # u < p/q, without dividing by q
    num_accepted = accepted_prefix(accept)
    rows = torch.arange(n, device=drafts.device)
    p_at = target_probs[rows, num_accepted]                                   # [n, V]
    q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
    residual = (p_at - q_pad[rows, num_accepted]).clamp_(min=0)               # q = 0 for the bonus
    empty = residual.sum(-1, keepdim=True) <= 0       # p == q up to rounding: fall back to p
    residual = torch.where(empty, p_at, residual)
    final = sample(residual, u_final[rows, num_accepted])
    emitted = torch.cat([drafts, drafts[:, :1]], dim=1)
    emitted[rows, num_accepted] = final
    return num_accepted, emitted
