"""Large CPU tensors on 2 MB pages (Linux transparent huge pages) where the kernel allows it.

A CPU step streams every weight once (the demo's 21 MB of float16 panels, a 7B model's GBs) and
reads each row's keys and values. On 4 KB pages that is a TLB entry per 4 KB, far more than a
core's TLB holds, so a step walks the page tables over and over and the hardware prefetchers stop
at every page edge. The same GEMVs over the demo's weights took 1.44x as long on 4 KB pages as
on 2 MB ones at 1 row, 1.17x at 8 (Zen 4, one thread; docs/decisions.md, stop 55). torch's
allocator has no say over pages, so these tensors live in anonymous mappings advised
MADV_HUGEPAGE (honoured where /sys/kernel/mm/transparent_hugepage/enabled is `always` or
`madvise`). Without madvise (another OS) they are ordinary torch tensors; with THP off they are
ordinary 4 KB pages. `HUGE_PAGES = False` turns it off (benchmark baselines).

Example: `pages.empty((24, 256, 64), torch.float16)` is a float16 tensor in the shared arena,
64-byte aligned; `pages.zeros(shape, torch.float32)` is a mapping of its own (a KV cache).
"""
from __future__ import annotations

import mmap

import torch

HUGE = 2 << 20          # bytes in a huge page
CHUNK = 64 << 20        # bytes an arena mapping reserves; pages never touched take no memory
ALIGN = 64              # bytes each arena tensor starts on (a cache line)
HUGE_PAGES = True


def _mapping(nbytes: int) -> torch.Tensor | None:
    """A zeroed uint8 tensor of `nbytes` on its own anonymous mapping advised MADV_HUGEPAGE,
    starting on a 2 MB boundary; None where that cannot be had."""
    if not HUGE_PAGES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    whole = torch.frombuffer(m, dtype=torch.uint8)          # holds the mapping while any view lives
    start = -whole.data_ptr() % HUGE
    return whole[start:start + nbytes]


def _nbytes(shape, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * dtype.itemsize


class Arena:
    """Tensors carved from CHUNK-sized huge-page mappings, each ALIGN-aligned; a request larger
    than a chunk gets a mapping of its own. Freed with the last tensor of each mapping."""

    def __init__(self):
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = _nbytes(shape, dtype)
        if nbytes == 0 or not HUGE_PAGES:
            return torch.empty(shape, dtype=dtype)
        if nbytes > CHUNK:
            own = _mapping(nbytes)
            return torch.empty(shape, dtype=dtype) if own is None else own.view(dtype).view(shape)
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            self._chunk, self._used = _mapping(CHUNK), 0
            if self._chunk is None:
                return torch.empty(shape, dtype=dtype)
        out = self._chunk[self._used:self._used + nbytes].view(dtype).view(shape)
        self._used += -(-nbytes // ALIGN) * ALIGN
        return out


_ARENA = Arena()


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in the process's huge-page arena (a weight that lives as long
    as its model)."""
    return _ARENA.empty(shape, dtype)


def zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on a huge-page mapping of its own (freed with it), else torch.zeros
    (also under one huge page: nothing to gain)."""
    nbytes = _nbytes(shape, dtype)
    own = _mapping(nbytes) if nbytes >= HUGE else None
    return torch.zeros(shape, dtype=dtype) if own is None else own.view(dtype).view(shape)
