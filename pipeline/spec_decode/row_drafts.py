"""Per-row draft source and length: expected accepted tokens per unit of verify cost.

Each row i has, from each source, a proposal of avail_i drafts whose j-th is kept with
probability P_ij = prod_{k<=j} a_k (a_k: that source's measured per-depth acceptance, for an
n-gram draft at its match length). A row takes the source with the larger expected accepted
tokens sum_j P_ij. Then over all rows at once, with a ragged verify costing

    step_s(D) = base_s + [D > 0] * first_s + D * token_s          (D: drafts in the step)

the step keeps the D drafts of largest P (a row's P falls with depth, so that is a prefix of
each row) for the D that maximises goodput (rows + sum of kept P) / step_s(D), or none where
that is within `min_gain` of plain decoding.

`padded_lengths` prices a padded verify instead (its cost is the widest row's, for every row).

Example: 2 rows, P = [[0.9, 0.8], [0.2, 0.0]], base_s 10, first_s 0, token_s 1: keeping
0.9, 0.8 gives (2 + 1.7) / 12 = 0.308 tokens/s-unit against 2 / 10 = 0.2, adding 0.2 gives
3.9 / 13 = 0.300: lengths [2, 0].
"""
from __future__ import annotations

import torch

from pipeline.spec_decode.policy import estimate_acceptance

MATCH_PRIOR = {1: 0.3, 2: 0.5, 3: 0.7}     # a_1 prior of an n-gram draft by match length


def acceptance_table(reached: dict[str, list[int]], accepted: dict[str, list[int]], prefix: str,
                     depth: int, max_match: int = 3) -> torch.Tensor:
    """[max_match + 1, depth] per-depth acceptance of `prefix:m` drafts (row m; row 0 all zero),
    from counts keyed "ngram:1".. with a Beta prior (MATCH_PRIOR)."""
    table = torch.zeros(max_match + 1, depth, dtype=torch.float64)
    for m in range(1, max_match + 1):
        key = f"{prefix}:{m}"
        table[m] = torch.tensor(estimate_acceptance(reached.get(key, []), accepted.get(key, []), depth,
                                                    prior_mean=MATCH_PRIOR.get(m, 0.5)), dtype=torch.float64)
    return table


def keep_probs(acceptance: torch.Tensor, avail: torch.Tensor) -> torch.Tensor:
    """acceptance [n, G] per-depth a_k of each row's source, avail [n] its proposal's length ->
    P [n, G], 0 beyond avail. Example: a [[0.5, 0.5, 0.5]], avail [2] -> [[0.5, 0.25, 0]]."""
    p = acceptance.cumprod(dim=1)
    return p * (torch.arange(p.shape[1]) < avail[:, None])


def draft_lengths(p: torch.Tensor, base_s: float, token_s: float, first_s: float = 0.0,
                  min_gain: float = 0.0) -> torch.Tensor:
    """P [n, G] -> drafts to verify per row [n] (module docstring); rows with P 0 get 0."""
    n, g = p.shape
    if g == 0 or n == 0:
        return torch.zeros(n, dtype=torch.long)
    flat, order = p.flatten().sort(descending=True)
    k = torch.arange(1, flat.numel() + 1, dtype=torch.float64)
    goodput = (n + flat.double().cumsum(0)) / (base_s + first_s + token_s * k)
    best = int(goodput.argmax())
    if flat[best] <= 0 or goodput[best] <= (1 + min_gain) * n / base_s:
        return torch.zeros(n, dtype=torch.long)
    keep = torch.zeros(n * g, dtype=torch.bool)
    keep[order[:best + 1]] = True
    return keep.view(n, g).long().cumprod(dim=1).sum(dim=1)


def padded_lengths(p: torch.Tensor, base_s: float, token_s: float, first_s: float = 0.0,
                   min_gain: float = 0.0) -> torch.Tensor:
    """Drafts per row when every row verifies W + 1 slots (a padded verify prices the width,
    not the drafts): W maximises (rows + sum_{j<W} P_ij) / (base_s + first_s + rows * W * token_s),
    and each row drafts what it has below W. Example: P [[0.9, 0.8], [0.2, 0]], base 10, token 1:
    W=1: 3.1 / 12 = 0.26, W=2: 3.9 / 14 = 0.28, plain 2 / 10 -> W=2, lengths [2, 1]."""
    n, g = p.shape
    if g == 0 or n == 0:
        return torch.zeros(n, dtype=torch.long)
    gain = p.double().sum(0).cumsum(0)                                       # [G] tokens over width W
    w = torch.arange(1, g + 1, dtype=torch.float64)
    goodput = (n + gain) / (base_s + first_s + n * w * token_s)
    best = int(goodput.argmax())
    if goodput[best] <= (1 + min_gain) * n / base_s:
        return torch.zeros(n, dtype=torch.long)
    return (p[:, :best + 1] > 0).long().cumprod(dim=1).sum(dim=1)
