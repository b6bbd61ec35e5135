"""KV cache with a length per row, and the per-forward `Batch` that says where to read and write.

Rows advance by different amounts each step. A row's length lives with the engine; the cache
only stores keys and values by absolute position. Rolling back rejected drafts is therefore a
length change: stale slots beyond a row's length are masked out and overwritten by the next
write, never copied or recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline.model import pages


@dataclass
class Batch:
    """Which cache rows a forward touches and at which absolute positions.

    rows:      [n] cache row of each batch row
    positions: [n, q] absolute position of each query token
    kv_len:    keys 0..kv_len-1 are attended (the cache is read only up to there)
    key_valid: optional [n, kv_len] keys that may be attended at all (MTP caches have holes)
    prefix:    True when rows == arange(n): cache reads are views, not gathers
    from_zero: every row's queries are positions 0..q-1 and the keys are exactly those: plain
               causal attention, no mask tensor (a [n, 1, q, q] mask is large for long prompts)
    cos, sin:  [n, q, head_dim] rotary tables for `positions`, set by the model (sin folded:
               pipeline.model.layers.fold_sin)
    """
    rows: torch.Tensor
    positions: torch.Tensor
    kv_len: int
    key_valid: torch.Tensor | None = None
    prefix: bool = False
    from_zero: bool = False
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict, repr=False)

    @classmethod
    def make(cls, positions: torch.Tensor, rows: torch.Tensor | None = None,
             kv_len: int | None = None, key_valid: torch.Tensor | None = None) -> "Batch":
        n = positions.shape[0]
        prefix = rows is None
        if rows is None:
            rows = torch.arange(n, device=positions.device)
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        return cls(rows, positions, kv_len, key_valid, prefix)

    @classmethod
    def from_start(cls, batch_size: int, length: int, device, rows: torch.Tensor | None = None) -> "Batch":
        """Whole sequences from position 0 (prefill, training): causal attention, no mask tensor."""
        positions = torch.arange(length, device=device).expand(batch_size, length)
        batch = cls.make(positions, rows=rows, kv_len=length)
        batch.from_zero = True
        return batch

    def mask(self, window: int | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """[n, 1, q, kv_len] bool: key j is visible to the query at position p iff j <= p,
        j > p - window (sliding layers), and key_valid allows j (or j == p). None where plain
        causal attention says the same (`from_zero`, no window, no key_valid). With `dtype`:
        the additive form (0 visible, -inf not) that attention makes of a bool mask at every
        call, made once per forward instead of once per layer (the same scores)."""
        if self.from_zero and window is None and self.key_valid is None:
            return None
        if dtype is not None:
            if (window, dtype) not in self._masks:
                allowed = self.mask(window)
                self._masks[window, dtype] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device
                                                         ).masked_fill_(~allowed, float("-inf"))
            return self._masks[window, dtype]
        if window not in self._masks:
            keys = torch.arange(self.kv_len, device=self.positions.device)      # [T]
            pos = self.positions[:, :, None]                                    # [n, q, 1]
            allowed = keys <= pos
            if window is not None:
                allowed &= keys > pos - window
            if self.key_valid is not None:   # a query always sees itself: no all-masked rows, no NaN
                allowed &= self.key_valid[:, None, :] | (keys == pos)
            self._masks[window] = allowed[:, None]
        return self._masks[window]


class KVCache:
    """Keys and values for `num_layers` layers and `batch_size` rows, by absolute position."""

    def __init__(self, num_layers: int, batch_size: int, capacity: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        if torch.device(device).type == "cpu":       # read every step: on 2 MB pages (pipeline.model.pages)
            self.k, self.v = pages.zeros(shape, dtype), pages.zeros(shape, dtype)   # [layers, rows, kv_heads, T, d]
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity

    def fits(self, num_layers: int, batch_size: int, capacity: int, num_kv_heads: int, head_dim: int) -> bool:
        """Whether this cache can serve a call that needs the given size (it may be larger)."""
        layers, rows, kv_heads, t, d = self.k.shape
        return (layers, kv_heads, d) == (num_layers, num_kv_heads, head_dim) and rows >= batch_size and t >= capacity

    def write(self, layer: int, batch: Batch, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n, kv_heads, q, d] for the query positions of `batch`."""
        rows, pos = batch.rows[:, None], batch.positions                     # [n, 1], [n, q]
        self.k[layer][rows, :, pos] = k.transpose(1, 2)
        self.v[layer][rows, :, pos] = v.transpose(1, 2)

    def read(self, layer: int, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [n, kv_heads, kv_len, d] for the rows of `batch`."""
        t = batch.kv_len
        if batch.prefix:
            n = batch.rows.shape[0]
            return self.k[layer, :n, :, :t], self.v[layer, :n, :, :t]
        return self.k[layer, batch.rows, :, :t], self.v[layer, batch.rows, :, :t]

    def move_row(self, src: int, dst: int, length: int | None = None) -> None:
        """Copy one row onto another (used to keep active rows contiguous, never for rollback);
        `length`: only its first `length` positions hold anything (the rest is masked and
        overwritten), so only those are copied. A held cache is sized for the largest call so
        far: at batch 48 whole-capacity copies were 45 ms of a 750 ms summarize call."""
        t = slice(None) if length is None else slice(0, length)
        self.k[:, dst, :, t] = self.k[:, src, :, t]
        self.v[:, dst, :, t] = self.v[:, src, :, t]
