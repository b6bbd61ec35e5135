"""The machine's ceilings, measured: matrix-multiply FLOP/s and memory bandwidth; and the
ideal time of a decode step at those ceilings (roofline), so the report can say how close the
engine gets. A verify step over N tokens reads every weight once and does 2 * params * N FLOPs:

    ideal_s(N) = max(weight_bytes / bandwidth, 2 * params * N / flops)

(attention over the KV cache is left out: it is small next to the weights for short contexts).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


def _timed(fn, device, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def peak_matmul_flops(device, dtype, n: int | None = None) -> float:
    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / _timed(lambda: a @ b, device)


def memory_bandwidth(device, megabytes: int | None = None) -> float:
    """Bytes per second of a large copy (read + write)."""
    mb = megabytes or (2048 if device.type == "cuda" else 256)
    src = torch.empty(mb * 2 ** 20 // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _timed(lambda: dst.copy_(src), device)


@dataclass(frozen=True)
class Roofline:
    flops: float              # matmul FLOP/s measured
    bandwidth: float          # bytes/s measured
    params: int               # parameters read per target forward
    weight_bytes: int

    def step_s(self, tokens: int) -> float:
        return max(self.weight_bytes / self.bandwidth, 2 * self.params * tokens / self.flops)


def measure_roofline(engine) -> Roofline:
    target = engine.target
    params = sum(p.numel() for p in target.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    return Roofline(peak_matmul_flops(engine.device, engine.dtype), memory_bandwidth(engine.device),
                    params, weight_bytes)
