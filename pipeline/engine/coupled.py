"""Coupled verification's token picks for one generate call (DESIGN.md invariant 2).

The token landing at position t of a row is coupled_sample(p, E) with E =
rng.exponential_noise(seed, row key, t): the target's, and every draft's for that position, so
a draft is kept exactly when it equals the target's token (coupled_accept) and the text is what
plain sampling with that noise gives. A verify step needs the noise of positions its drafts
already drew: a draft's full-vocabulary noise is kept until the step's target pick reuses it
(gamma + 1 positions hashed per step instead of 2 gamma + 1).
"""
from __future__ import annotations

import torch

from pipeline.spec_decode import rng
from pipeline.spec_decode.sampling import coupled_sample, sparse_coupled_sample


class CoupledSampler:
    def __init__(self, seed: int, filtered: bool = False, noise=None):
        """filtered: top-k or top-p is on, so most tokens may have zero probability and noise
        for the kept ones alone may do (counting them costs a pass, paid only then). `noise`:
        a function of rng.exponential_noise's values (the engine's: native's C one on CPU),
        used for all of the call's noise; default rng's."""
        self.seed, self.filtered, self.noise = seed, filtered, noise or rng.exponential_noise
        self._kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []   # (keys [n], positions [n], noise [n, V])

    def draft(self, probs: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """probs [n, V] (filtered), keys [n], positions [n] -> tokens [n]."""
        tokens = sparse_coupled_sample(probs, self.seed, keys, positions, noise=self.noise) if self.filtered else None
        if tokens is not None:                                                   # top-k/p: kept tokens only
            return tokens
        noise = self.noise(self.seed, keys, positions, probs.shape[-1])            # [n, V]
        self._kept.append((keys, positions, noise))
        return coupled_sample(probs, noise)

    def target(self, probs: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """probs [n, V] or [n, q, V]; positions [n] or [n, q] -> tokens like positions.
        Ends the step: the drafts' kept noise is released."""
        tokens = sparse_coupled_sample(probs, self.seed, keys, positions, noise=self.noise) if self.filtered else None
        if tokens is None:
            tokens = coupled_sample(probs, self._noise(keys, positions, probs.shape[-1]))
        self._kept = []
        return tokens

    def _noise(self, keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
        """[*positions.shape, V]: a column a draft drew (same keys and positions) reused, the rest computed."""
        cols = positions if positions.dim() == 2 else positions[:, None]           # [n, q]
        noise = [next((e for k, q, e in self._kept if q.shape == c.shape and torch.equal(q, c) and torch.equal(k, keys)),
                      None) for c in cols.unbind(1)]
        missing = [j for j, e in enumerate(noise) if e is None]
        if len(missing) == len(noise):
            return self.noise(self.seed, keys, positions, vocab)
        if missing:
            fresh = self.noise(self.seed, keys, cols[:, missing], vocab)              # [n, m, V]
            for i, j in enumerate(missing):
                noise[j] = fresh[:, i]
        if len(noise) == 1:
            return noise[0].view(*positions.shape, vocab)
        return torch.stack(noise, dim=1)                                            # [n, q, V]


class CoupledDraftPick:
    """A coupled, unfiltered step's draft pick: `pick(logits, depth)` as the engine's lambda, plus
    what a drafter needs to pick the same tokens in its own C loop (native.mtp_greedy's
    `coupled`): `temperature`, `seed`, the rows' `keys` [n]. Drafts are proposals only (the target's
    coupled pick decides every token), so a C pick that rounds apart from torch's near a tie changes
    at most an acceptance, never the text."""

    def __init__(self, pick, temperature: float, seed: int, keys: torch.Tensor):
        self.pick, self.temperature, self.seed, self.keys = pick, temperature, seed, keys

    def __call__(self, logits: torch.Tensor, depth: int):
        return self.pick(logits, depth)
