"""Weights and KV caches on 2 MB pages (pipeline.model.pages)."""
from pathlib import Path

import pytest
import torch

from pipeline.model import native, pages
from pipeline.model.cache import KVCache


def _vma_flags(address: int) -> dict:
    """The /proc/self/smaps fields of the mapping holding `address`."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _thp_possible() -> bool:
    p = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return p.exists() and "[never]" not in p.read_text() and hasattr(__import__("mmap"), "MADV_HUGEPAGE")


def test_arena_tensors_are_aligned_apart_and_writable():
    """Tensors carved from the arena: their shapes and dtypes, 64-byte aligned, no two
    overlapping, a request past a chunk on a mapping of its own; with HUGE_PAGES off, plain ones."""
    arena = pages.Arena()
    shapes = [((24, 256, 64), torch.float16), ((3,), torch.float32), ((7, 5), torch.float16), ((100,), torch.int64)]
    ts = [arena.empty(s, d) for s, d in shapes]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    for t, (s, d) in zip(ts, shapes):
        assert t.shape == s and t.dtype == d and t.data_ptr() % pages.ALIGN == 0 and t.is_contiguous()
        t.fill_(1)
    assert all(float(t.float().sum()) == t.numel() for t in ts)
    big = arena.empty((pages.CHUNK // 2 + 8,), torch.int16)       # more bytes than a chunk
    assert big.numel() == pages.CHUNK // 2 + 8 and big.data_ptr() % pages.HUGE == 0


def test_with_huge_pages_off_tensors_are_torchs(monkeypatch):
    monkeypatch.setattr(pages, "HUGE_PAGES", False)
    t = pages.Arena().empty((4, 4), torch.float32)
    z = pages.zeros((1 << 20,), torch.float32)
    assert t._base is None and z._base is None and float(z.abs().sum()) == 0


@pytest.mark.skipif(not _thp_possible(), reason="no transparent huge pages on this machine")
def test_packed_weights_and_large_kv_caches_sit_on_mappings_advised_for_huge_pages():
    """native.pack's panels and a CPU KV cache of at least 2 MB are on mappings the kernel may
    back with 2 MB pages (smaps: THPeligible 1), the cache's start on a 2 MB boundary and zeroed;
    a small cache stays torch's."""
    packed = native.pack(torch.randn(300, 64))
    cache = KVCache(2, 4, 512, 2, 64, torch.float32, "cpu")        # 2 MB a tensor
    assert cache.k.data_ptr() % pages.HUGE == 0 and float(cache.v.abs().sum()) == 0
    for t in (packed, cache.k, cache.v):
        assert _vma_flags(t.data_ptr()).get("THPeligible") == "1"
    small = KVCache(1, 1, 8, 1, 4, torch.float32, "cpu")
    assert small.k._base is None
