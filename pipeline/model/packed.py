"""Inference-only weight layouts for CPUs: what a linear layer's weight is stored as.

On a CPU, `F.linear(x, W)` with the checkpoint's [out, in] weight switches to a slower kernel
from 4 input rows on (one thread, demo model: its 6,144 x 256 output projection takes 0.45 ms
for 4 rows against 0.24 ms for 1), so verifying gamma + 1 >= 4 tokens cost 1.4x a 1-token
step. `x @ W_t` with W_t [in, out] contiguous stays flat in the rows (0.25 ms at 4, 0.28 at 8)
and is no slower at batch 48 (docs/decisions.md, 2026-12-01): `PackedLinear`.

Even so MKL's float32 GEMM reads 4 bytes a weight, and in a forward each weight comes from L3
or memory (a model's weights together are far larger than a core's L2). FBGEMM's GEMM with
float16-stored weights (products and sums in float32) reads half of that: for a few input rows,
where a linear is bound by reading its weight, it costs 0.55-0.8x of MKL's (demo shapes, 1-8
rows, one thread, on a Zen 3 EPYC and a Sapphire Rapids Xeon); from a few dozen rows on, where
the arithmetic binds, MKL is 10-25% faster (docs/decisions.md, 2026-12-05). So
`Fp16WeightLinear` keeps both and takes FBGEMM up to `max_rows` input rows, a crossover that
`fp16_gemm_rows` measures once per weight shape and thread count on the running machine.

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


class Fp16WeightLinear(PackedLinear):
    """y = x @ weight.T + bias for a float32 weight [out, in] that float16 holds exactly
    (`fp16_exact`): inputs of up to `max_rows` rows (None: any) by FBGEMM's GEMM over the
    weight packed as float16, larger ones by `PackedLinear`'s float32 GEMM. x: [..., in] on CPU.

    The packed matrix is an opaque handle, not a tensor of values: it is held as a plain
    attribute (not in the state dict) and the module cannot be copied, saved or moved."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, max_rows: int | None = None):
        super().__init__(_linear(weight, bias))
        self.max_rows = max_rows
        self._packed = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(weight.detach().float().contiguous())
        self._bias = torch.zeros(self.out_features) if bias is None else bias.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_rows is not None and x.numel() > self.max_rows * self.in_features:
            return super().forward(x)
        return torch.ops.aten.fbgemm_linear_fp16_weight(x, self._packed, self._bias)

    def __deepcopy__(self, memo):
        raise TypeError("Fp16WeightLinear holds a native packed handle; rebuild it from its weight")


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear holding these tensors (no copy, no initialisation)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


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


ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
FIRST_GAIN = 0.9        # at one row FBGEMM must take at most this share of the float32 time ...
LATER_GAIN = 1.0        # ... and at more rows no more than it


def crossover(times: dict) -> int:
    """The `max_rows` for FBGEMM from measured seconds {rows: (float32, float16-weight)}: the
    largest row count up to which it wins at every one measured. Winning at one row means
    FIRST_GAIN (a second, packed copy of the weight is worth it only for a clear gain); beyond,
    no slower (LATER_GAIN). Parity, not a margin, past one row: its lead shrinks with the rows
    (0.67-0.83x at 8 rows on the demo's shapes), and a 10% margin there put a shape's crossover
    at 4 in one process and 8 in the next, so a 6-token verify ran another kernel per load
    (docs/decisions.md, stop 48). Example: {1: (10, 7), 2: (11, 8), 4: (12, 12.5)} -> 2."""
    won = 0
    for rows in sorted(times):
        fp32, fp16 = times[rows]
        if fp16 >= (FIRST_GAIN if rows == 1 else LATER_GAIN) * fp32:
            break
        won = rows
    return won


@functools.lru_cache(maxsize=None)
def fp16_gemm_rows(out_features: int, in_features: int, threads: int) -> int:
    """Up to how many input rows FBGEMM's float16-weight GEMM is to be used for an [out, in]
    weight on this machine (`crossover` of its timings at ROWS, stopping at the first row count
    it loses). Timed as in a forward, with the weight out of L2: each round runs a copy after
    copy of it, 16 MiB in all; per kernel the fastest of 5 interleaved rounds, so a busy spell
    of a shared machine hits both alike. Once per process, weight shape and `threads` (torch's
    thread count); about 0.1-0.3 s for a 256 x 6,144 weight."""
    import time
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).half().float()
    copies = min(64, max(2, -(-(16 << 20) // (4 * w.numel()))))
    fp32 = [w.t().contiguous() for _ in range(copies)]
    fp16 = [Fp16WeightLinear(w) for _ in range(copies)]
    times = {}
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, in_features, generator=gen)
            best = [float("inf"), float("inf")]
            for _ in range(5):
                for i, run in enumerate((lambda: [x @ wt for wt in fp32], lambda: [f(x) for f in fp16])):
                    t0 = time.perf_counter()
                    run()
                    best[i] = min(best[i], time.perf_counter() - t0)
            times[rows] = tuple(best)
            if crossover(times) < rows:
                break
    return crossover(times)


def cpu_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """The CPU module computing x @ weight.T + bias fastest on this machine that this weight
    admits (module docstring). weight: [out, in], float32 or not."""
    if weight.device.type == "cpu" and fp16_exact(weight) and fp16_gemm_works():
        rows = fp16_gemm_rows(*weight.shape, torch.get_num_threads())
        if rows:
            return Fp16WeightLinear(weight, bias, max_rows=rows)
    return PackedLinear(_linear(weight, bias))


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
