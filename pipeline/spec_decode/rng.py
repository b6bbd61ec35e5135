"""Counter-based random numbers: a uniform for every (seed, row, position, stream).

A row's randomness depends only on its own key and on token positions, never on which slot or
batch it ran in, so a seeded run reproduces its outputs whatever the batch size, actor or retry.
Each uniform decides at most one emitted token, which keeps speculative sampling lossless:
a uniform drawn for a draft that was later discarded influenced nothing that was kept.
"""
from __future__ import annotations

import torch

# Streams: what a uniform is used for. Drafts and accept tests get one stream per use.
TARGET = 0      # a token sampled from the target (gamma 0, recovered, bonus)
DRAFT = 1       # a draft token sampled from an MTP head
ACCEPT = 2      # the accept test of a draft token

_MASK64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 torch stores."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser on int64 tensors (multiplication wraps, as in C)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def uniforms(seed: int, row_keys: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in [0, 1), float64, shaped like `positions`.

    row_keys: [n] int64 (one key per row); positions: [n] or [n, q] int64.
    """
    keys = row_keys.to(torch.int64).view(-1, *([1] * (positions.dim() - 1)))
    x = splitmix64(torch.full_like(keys, _i64(seed)) ^ _i64(stream * 0x632BE59BD9B4E019))
    x = splitmix64(x ^ keys)
    x = splitmix64(x ^ positions.to(torch.int64))
    return _shr(x, 11).to(torch.float64) * (1.0 / (1 << 53))
