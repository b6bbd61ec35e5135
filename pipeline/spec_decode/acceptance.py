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

from pipeline.spec_decode.sampling import sample


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


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor):
    """Greedy verification.

    drafts: [n, gamma]; target_logits: [n, gamma + 1, V].
    Returns (num_accepted [n], emitted [n, gamma + 1]) where row i emits emitted[i, :num_accepted[i] + 1]:
    the target's argmax at every position, which equals the accepted drafts on the accepted prefix.
    Example: drafts [[5, 7]], argmax [[5, 9, 4]] -> num_accepted [1], emitted row [5, 9, 4] (emit 5, 9).
    """
    return coupled_accept(drafts, target_logits.argmax(dim=-1))         # target: [n, gamma + 1]


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
