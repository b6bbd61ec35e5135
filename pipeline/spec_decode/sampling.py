"""Turning logits into distributions and tokens. Free functions, batched, no state."""
from __future__ import annotations

import torch

from pipeline.spec_decode import rng

ARGMAX_BLOCK = 128          # argmax_last: values per block of its first pass
BLOCKED_ARGMAX_MIN = 20000  # ... and the fewest values it takes that pass for (below, torch.argmax is faster)


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1): the first index of the largest value along the last dimension. On a
    CPU in two passes: each block of ARGMAX_BLOCK values' largest (amax is vectorised there;
    argmax is not), then the first block holding the row's largest and the first index in it.
    At 48 rows of 6,144 logits 0.13 ms against 0.61; 4 tokens of a 151,936 vocabulary 0.16 ms
    against 1.2 (a 2-core Xeon, 1 thread; docs/decisions.md, stop 41). Elsewhere, and under
    BLOCKED_ARGMAX_MIN values, torch.argmax.
    Example: [[1, 5, 5, 2]] in blocks of 2: block maxima [5, 5] -> block 0 -> index 1."""
    v = x.shape[-1]
    if x.device.type != "cpu" or x.numel() < BLOCKED_ARGMAX_MIN or v < 2 * ARGMAX_BLOCK:
        return x.argmax(-1)
    b = ARGMAX_BLOCK
    whole = v // b * b
    block_max = x[..., :whole].unflatten(-1, (v // b, b)).amax(-1)                  # [..., v // b]
    if whole < v:
        block_max = torch.cat([block_max, x[..., whole:].amax(-1, keepdim=True)], dim=-1)
    first = block_max.argmax(-1, keepdim=True) * b                                    # [..., 1]
    idx = (first + torch.arange(b, device=x.device)).clamp_(max=v - 1)   # the block (the last one is short)
    return idx.gather(-1, x.gather(-1, idx).argmax(-1, keepdim=True)).squeeze(-1)


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Probabilities [..., V] after temperature, top-k and top-p (nucleus) filtering.

    temperature must be > 0 here; greedy decoding does not build distributions.
    Example: logits [0, 0, ln 2] with temperature 1 -> [0.25, 0.25, 0.5]; with top_k=1 -> [0, 0, 1].
    """
    logits = logits.float() / temperature
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p            # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per distribution from one uniform.

    probs: [..., V] (need not be normalised); u: [...] in [0, 1). Returns int64 [...].
    A token with zero probability is never returned.
    """
    cdf = probs.double().cumsum(-1)                                   # [..., V]
    x = (u.double() * cdf[..., -1]).unsqueeze(-1)                     # [..., 1]
    idx = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def coupled_sample(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Gumbel-max sampling with given noise: argmax_v(log p_v + g_v), g_v = -log(noise_v) Gumbel,
    computed as argmax_v(p_v / noise_v) (the exponential race; one log fewer per token).

    probs: [..., V] (need not be normalised; temperature, top-k and top-p already applied);
    noise: [..., V] Exp(1) values (rng.exponential_noise). Returns int64 [...]. With independent
    noise the token follows probs exactly; with the same noise, the target and a drafter pick
    the same token wherever their distributions agree enough, which is what coupled verification
    accepts. A token with zero probability is never returned.
    Example: probs [0.5, 0.3, 0.2], noise [2.0, 0.5, 1.0] -> ratios [0.25, 0.6, 0.2] -> token 1.
    """
    return argmax_last(probs.float() / noise)


def sparse_coupled_sample(probs: torch.Tensor, seed: int, row_keys: torch.Tensor, positions: torch.Tensor,
                          max_share: float = 0.25, noise=None) -> torch.Tensor | None:
    """coupled_sample(probs, rng.exponential_noise(seed, row_keys, positions, V)), drawing noise
    only for the tokens a filter kept; None where some row keeps more than `max_share` of the
    vocabulary (then the full noise is as cheap, and the caller draws it).

    probs: [..., V] after top-k / top-p; row_keys [n]; positions [n] or [n, q] like probs[..., 0].
    The noise of a token depends on its id, not on which others are drawn, and a token of zero
    probability never wins, so the tokens are those of the full computation.
    `noise`: a function of rng.exponential_noise's values (the caller's for all its noise;
    default rng's). Example: top_k=50 over V=6144 hashes 50 values per position instead of 6144.
    """
    kept = int((probs > 0).sum(-1).max())
    if kept > max_share * probs.shape[-1]:
        return None
    values, ids = probs.topk(kept, dim=-1)                                       # [..., kept]
    e = (noise or rng.exponential_noise)(seed, row_keys, positions, probs.shape[-1], tokens=ids)
    return ids.gather(-1, coupled_sample(values, e)[..., None])[..., 0]


class GreedyPick:
    """The draft pick of greedy decoding, `pick(logits, depth) -> (argmax, None)`, marked
    `greedy` so a drafter may take the argmax its own way (the MTP drafter's C path,
    pipeline.engine.drafter)."""
    greedy = True

    def __call__(self, logits: torch.Tensor, depth: int):
        return argmax_last(logits), None


GREEDY_PICK = GreedyPick()
