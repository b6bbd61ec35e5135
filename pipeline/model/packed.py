"""Inference-only weight layouts for CPUs: what a linear layer's weight is stored as.

On a CPU, `F.linear(x, W)` with the checkpoint's [out, in] weight switches to a slower kernel
from 4 input rows on (one thread, demo model: its 6,144 x 256 output projection takes 0.45 ms
for 4 rows against 0.24 ms for 1), so verifying gamma + 1 >= 4 tokens cost 1.4x a 1-token
step. `x @ W_t` with W_t [in, out] contiguous stays flat in the rows (0.25 ms at 4, 0.28 at 8)
and is no slower at batch 48 (docs/decisions.md, 2026-12-01): `PackedLinear`.

Even so, on some CPUs MKL's float32 GEMM runs 2-16 rows at a quarter of peak: on a Zen 3
EPYC 2 rows cost 1.9x one. FBGEMM's GEMM with float16-stored weights (products and sums in
float32) reads half the bytes; where it wins depends on the machine, not the model. On that
EPYC it cost 0.4-0.6x of MKL for every linear of the demo from 2 to 16 rows; on a Sapphire
Rapids Xeon (2 MiB L2) MKL is 1.5x faster on the layers' small matrices and FBGEMM 1.5-1.9x
faster on the 6 MiB output projection (docs/decisions.md, 2026-12-05). So `cpu_linear` times
both kernels once per weight shape and thread count on the running machine and keeps the
faster, FBGEMM only by a clear margin.

FBGEMM is used only for a weight that float16 holds exactly (every value survives the round
trip): then it computes the checkpoint's own linear, as a float32 kernel would, in another
summation order. The demo checkpoint's weights are float16 values for this reason; a float32
weight float16 cannot hold keeps `PackedLinear`. CUDA's GEMMs take either layout, so the loader
packs on CPU only.
"""
from __future__ import annotations

import functools

import torch
from torch import nn


class PackedLinear(nn.Module):
    """y = x @ weight_t (+ bias); weight_t: [in, out] contiguous."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x: [..., in] -> [..., out]
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


class Fp16WeightLinear(nn.Module):
    """y = x @ weight.T + bias by FBGEMM's GEMM over `weight` packed as float16, for a float32
    weight that float16 holds exactly (`fp16_exact`). x: [..., in] float32 on CPU.

    The packed matrix is an opaque handle, not a tensor of values: it is held as a plain
    attribute (not in the state dict) and the module cannot be copied, saved or moved."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):  # weight: [out, in]
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)   # for subsets, tests
        self._packed = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(weight.detach().float().contiguous())
        self._bias = torch.zeros(self.out_features) if bias is None else bias.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.fbgemm_linear_fp16_weight(x, self._packed, self._bias)

    def __deepcopy__(self, memo):
        raise TypeError("Fp16WeightLinear holds a native packed handle; rebuild it from its weight")


def fp16_exact(weight: torch.Tensor) -> bool:
    """True when every value of float32 `weight` is a float16 value (finite, same bits back)."""
    return weight.dtype == torch.float32 and bool(torch.equal(weight.half().float(), weight))


@functools.lru_cache(maxsize=1)
def fp16_gemm_works() -> bool:
    """FBGEMM's float16-weight GEMM is in this torch build, runs on this CPU and gives float32
    results within rounding of a float32 matmul (checked once per process)."""
    try:
        w = torch.arange(-12, 12, dtype=torch.float32).reshape(6, 4) / 8       # float16 values
        x = torch.linspace(-1, 1, 12).reshape(3, 4)
        y = Fp16WeightLinear(w)(x)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return y.dtype == torch.float32 and torch.allclose(y, x @ w.t(), rtol=1e-5, atol=1e-6)


@functools.lru_cache(maxsize=None)
def fp16_gemm_faster(out_features: int, in_features: int, threads: int) -> bool:
    """Whether FBGEMM's float16-weight GEMM beats `PackedLinear`'s float32 one on this machine
    for an [out, in] weight, by at least 10% over 1 and 4 input rows (a batch-1 decode step and
    a short verify; from a few dozen rows on the two cost the same). The fastest of 15
    interleaved rounds per kernel, so a busy spell of a shared machine hits both alike; a few
    ms per shape, once per process and `threads` (torch's thread count)."""
    import time
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).half().float()
    w_t, fast = w.t().contiguous(), Fp16WeightLinear(w)
    xs = [torch.randn(rows, in_features, generator=gen) for rows in (1, 4)]
    reps = min(20, max(1, int(2e5 // (out_features * in_features))))    # rounds of ~0.1 ms
    best = {"fp32": [float("inf")] * 2, "fp16": [float("inf")] * 2}
    with torch.inference_mode():
        for _ in range(15):
            for i, x in enumerate(xs):
                for name, fn in (("fp32", lambda: x @ w_t), ("fp16", lambda: fast(x))):
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    best[name][i] = min(best[name][i], time.perf_counter() - t0)
    return sum(best["fp16"]) < 0.9 * sum(best["fp32"])


def cpu_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """The faster CPU module computing x @ weight.T + bias that this weight admits on this
    machine (see the module docstring). weight: [out, in], float32 or not."""
    if (weight.device.type == "cpu" and fp16_exact(weight) and fp16_gemm_works()
            and fp16_gemm_faster(*weight.shape, torch.get_num_threads())):
        return Fp16WeightLinear(weight, bias)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return PackedLinear(linear)


def pack_linears_(module: nn.Module) -> None:
    """Replace every nn.Linear under `module` by its `cpu_linear` (in place)."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, cpu_linear(child.weight, child.bias))
        else:
            pack_linears_(child)


def packing_pays(device: torch.device) -> bool:
    """Measured on CPU only (module docstring)."""
    return torch.device(device).type == "cpu"
