"""Counter-based random numbers: a uniform for every (seed, row, position, stream), and a
vector of exponential noise over the vocabulary for every (seed, row, position).

A row's randomness depends only on its own key and on token positions, never on which slot or
batch it ran in, so a seeded run reproduces its outputs whatever the batch size, actor or retry.
Rejection verification: each uniform decides at most one emitted token, which keeps it lossless
(a uniform drawn for a draft that was later discarded influenced nothing that was kept).
Coupled verification: the noise at a position decides the token there (pipeline.spec_decode.
sampling.coupled_sample), the same for the target and for every drafter.
"""
from __future__ import annotations

import torch

# Streams: what a uniform is used for. Drafts and accept tests get one stream per use.
TARGET = 0      # a token sampled from the target (gamma 0, recovered, bonus)
DRAFT = 1       # a draft token sampled from an MTP head
ACCEPT = 2      # the accept test of a draft token
NOISE = 3       # coupled verification: the exponential noise of a position (all tokens)

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


def counter_hash(seed: int, row_keys: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """int64 hash of (seed, row key, position, stream), shaped like `positions`.

    row_keys: [n] int64 (one key per row); positions: [n] or [n, q] int64.
    """
    keys = row_keys.to(torch.int64).view(-1, *([1] * (positions.dim() - 1)))
    x = splitmix64(torch.full_like(keys, _i64(seed)) ^ _i64(stream * 0x632BE59BD9B4E019))
    x = splitmix64(x ^ keys)
    return splitmix64(x ^ positions.to(torch.int64))


def uniforms(seed: int, row_keys: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniforms in [0, 1), float64, shaped like `positions`.

    row_keys: [n] int64 (one key per row); positions: [n] or [n, q] int64.
    """
    x = counter_hash(seed, row_keys, positions, stream)
    return _shr(x, 11).to(torch.float64) * (1.0 / (1 << 53))


_STRIDES: dict = {}     # (vocab, device) -> [V] int64 v * golden ratio, built once


def _strides(vocab: int, device) -> torch.Tensor:
    key = (vocab, str(device))
    if key not in _STRIDES:
        _STRIDES[key] = torch.arange(vocab, dtype=torch.int64, device=device) * _GOLDEN
    return _STRIDES[key]


def stream_word(seed: int, stream: int) -> int:
    """counter_hash's first step, splitmix64(seed ^ stream's word), as an unsigned 64-bit int
    (what a caller computing the rest elsewhere starts from; pipeline.model.native)."""
    z = ((seed ^ (stream * 0x632BE59BD9B4E019)) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def noise_states(seed: int, row_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 like `positions`: each position's SplitMix64 state before token 0's (token v's
    state is this + (v + 1) * golden, as `exponential_noise` says)."""
    return counter_hash(seed, row_keys, positions, NOISE) + _GOLDEN


def exponential_noise(seed: int, row_keys: torch.Tensor, positions: torch.Tensor, vocab: int,
                      tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Exp(1) noise E[..., v] for every token v at every (row, position): float32
    [*positions.shape, vocab], strictly positive, a function of (seed, key, position, v) alone.
    `tokens` [*positions.shape, m] (int64 ids): the noise of those tokens only, [..., m].

    Token v's value is output v of a SplitMix64 sequence started at the position's
    counter_hash (state + (v + 1) * golden, then the finaliser), so a position's noise is
    the same computed alone or in any batch, and two positions' sequences never overlap in
    practice (64-bit state). u = (top 23 bits + 0.5) / 2^23 lies in [2^-24, 1 - 2^-24] and
    E = -log(u) in [6e-8, 16.6]; -log(E) is then a Gumbel sample.
    Cost: ~20 passes over int64 [rows, V], in place; on a CPU in chunks of ~64K values that
    stay in cache (1.5x faster than one pass over everything; decisions.md, 2026-12-01).
    Example: exponential_noise(0, keys, positions, 6144)[i, j] equals
    exponential_noise(0, keys[i:i+1], positions[i:i+1, j:j+1], 6144)[0, 0], and its entries
    [3, 7] equal exponential_noise(0, keys, positions, 6144, tokens=ids)[i, j] where ids[i, j] = [3, 7].
    """
    base = noise_states(seed, row_keys, positions)                                   # like positions
    if tokens is not None:
        z = base.unsqueeze(-1) + tokens.to(torch.int64) * _GOLDEN                     # [..., m] states
        out = torch.empty(z.shape, dtype=torch.float32, device=z.device)
        return _exponentials_(z, torch.empty_like(z), out)
    base = base.reshape(-1)                                                          # [r] first states
    strides = _strides(vocab, positions.device)                                      # [V]
    out = torch.empty(base.numel(), vocab, dtype=torch.float32, device=positions.device)   # [r, V]
    chunk = base.numel() if positions.device.type != "cpu" else max(1, _CHUNK // vocab)
    z = torch.empty(min(chunk, base.numel()), vocab, dtype=torch.int64, device=positions.device)
    t = torch.empty_like(z)
    for lo in range(0, base.numel(), chunk):
        hi = min(lo + chunk, base.numel())
        torch.add(base[lo:hi, None], strides, out=z[:hi - lo])                       # SplitMix64 states
        _exponentials_(z[:hi - lo], t[:hi - lo], out[lo:hi])
    return out.view(*positions.shape, vocab)


def _exponentials_(z: torch.Tensor, t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser over states z (overwritten; t: scratch of z's shape), then
    out = -log(u) from the top 23 bits. Returns out."""
    for shift, mult in ((30, _M1), (27, _M2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=t)
        z.bitwise_xor_(t.bitwise_and_((1 << (64 - shift)) - 1))
        if mult is not None:
            z.mul_(mult)
    z.bitwise_right_shift_(41).bitwise_and_((1 << 23) - 1)                           # top 23 bits
    return out.copy_(z).add_(0.5).mul_(1.0 / (1 << 23)).log_().neg_()               # u -> -log(u)


_CHUNK = 1 << 16        # noise values per chunk on a CPU (two int64 buffers of 512 KiB)
