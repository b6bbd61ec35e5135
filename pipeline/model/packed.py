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
With one torch thread, where it builds (a C compiler, AVX-512), the float16 GEMM is the
project's own `half_gemm` (pipeline/model/native.py): one pass over the weight for up to 8
rows, so a 6-token verify's linears cost about what a 1-token step's do; FBGEMM's otherwise.

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

from pipeline.model import native
from pipeline.model.layers import Attention, DecoderLayer, RMSNorm


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
    (`fp16_exact`): inputs of up to `max_rows` rows (None: any) by a GEMM over the weight stored
    as float16, larger ones by `PackedLinear`'s float32 GEMM. x: [..., in] on CPU. The float16
    GEMM (`kernel`) is this project's `half_gemm` where it builds on this machine
    (pipeline/model/native.py), else FBGEMM's.

    The packed weight is a kernel's own layout (FBGEMM's an opaque native handle): it is held as
    a plain attribute (not in the state dict) and the module cannot be copied, saved or moved."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, max_rows: int | None = None,
                 kernel: str | None = None):
        super().__init__(_linear(weight, bias))
        self.max_rows = max_rows
        self.kernel = kernel or fp16_kernel()
        if self.kernel == "native":
            self._native = native.library().half_gemm
            self._packed = native.pack(weight)
            self._bias = native.pad_bias(bias, self.out_features)
            self._ptrs = (self._packed.data_ptr(), None if self._bias is None else self._bias.data_ptr())
        else:
            self._packed = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(weight.detach().float().contiguous())
            self._bias = torch.zeros(self.out_features) if bias is None else bias.detach().float().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_rows is not None and x.numel() > self.max_rows * self.in_features:
            return super().forward(x)
        if self.kernel == "native":                   # native.linear inlined: ~4 us a call less
            x = x.contiguous().float()                 # no copy for the engine's activations
            y = x.new_empty(x.shape[:-1] + (self.out_features,))
            rows = x.numel() // self.in_features
            if rows:
                self._native(rows, self.in_features, self.out_features, x.data_ptr(), *self._ptrs, y.data_ptr())
            return y
        return torch.ops.aten.fbgemm_linear_fp16_weight(x, self._packed, self._bias)

    def __deepcopy__(self, memo):
        raise TypeError("Fp16WeightLinear holds a packed weight; rebuild it from its weight")


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


def fp16_kernel() -> str:
    """The float16-weight GEMM for linears loaded now: "native" (half_gemm) where it builds, else
    "fbgemm". The engine runs half_gemm on torch's thread count (native.cpu_threads): on 2
    threads of a 2-core Zen 4 it decoded faster than FBGEMM and torch's modules on the same two
    (docs/decisions.md, stop 54)."""
    return "native" if native.library() is not None else "fbgemm"


@functools.lru_cache(maxsize=1)
def fp16_gemm_works() -> bool:
    """A float16-weight GEMM (`fp16_kernel`) runs on this CPU and gives float32 results within
    rounding of a float32 matmul (checked once per process; FBGEMM may be missing from a torch
    build)."""
    try:
        w = torch.arange(-12, 12, dtype=torch.float32).reshape(6, 4) / 8       # float16 values
        x = torch.linspace(-1, 1, 12).reshape(3, 4)
        y = Fp16WeightLinear(w)(x)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return y.dtype == torch.float32 and torch.allclose(y, x @ w.t(), rtol=1e-5, atol=1e-6)


ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)   # won at the last: any rows (`cpu_linear`)
FIRST_GAIN = 0.9        # at one row FBGEMM must take at most this share of the float32 time ...
LATER_GAIN = 1.0        # ... and at more rows no more than it


def crossover(times: dict, floor: int = 0) -> int:
    """The `max_rows` for the float16-weight GEMM from measured seconds {rows: (float32,
    float16-weight)}: the largest row count up to which it wins at every one measured above
    `floor` (rows up to `floor` count as won). The first win must be clear, FIRST_GAIN (a
    second, packed copy of the weight is worth it only for a clear gain); later ones no slower
    (LATER_GAIN). Parity, not a margin, after the first: the lead shrinks with the rows
    (0.67-0.83x at 8 rows on the demo's shapes), and a 10% margin there put a shape's crossover
    at 4 in one process and 8 in the next, so a 6-token verify ran another kernel per load
    (docs/decisions.md, stop 48). Example: {1: (10, 7), 2: (11, 8), 4: (12, 12.5)} -> 2;
    {8: (10, 10.5)} with floor 6 -> 6."""
    won = floor
    for rows in sorted(times):
        if rows <= floor:
            continue
        fp32, fp16 = times[rows]
        if fp16 >= (FIRST_GAIN if won == 0 else LATER_GAIN) * fp32:
            break
        won = rows
    return won


@functools.lru_cache(maxsize=None)
def fp16_gemm_rows(out_features: int, in_features: int, threads: int, kernel: str | None = None,
                   pool: int = 1) -> int:
    """Up to how many input rows the float16-weight GEMM (`fp16_kernel`) is to be used for an
    [out, in] weight on this machine: `crossover` of its timings at ROWS, stopping at the first
    row count it loses. Timed as in a forward, with the weight out of L2: each round runs a copy
    after copy of it, 16 MiB in all; per kernel the fastest of 5 interleaved rounds, so a busy
    spell of a shared machine hits both alike. Above 8 rows the arithmetic, not the weight's
    bytes, bounds both kernels: fewer copies (down to 2) keep a round's work about that of 8
    rows, and from 128 rows 3 rounds. Once per process, weight shape, `threads` (torch's
    thread count), `kernel` (default `fp16_kernel()`) and `pool` (the C kernels' threads,
    native.pool_threads; keys only: the timing runs as they are set); 0.1-0.2 s a weight, 0.6 s
    for a 256 x 6,144 one. Winning at every row count up to 512 (ROWS[-1]) means any count.

    The native kernel is taken up to `native.rows_per_pass()` rows (one read of a weight of half the bytes)
    without timing: this timing at 1-4 rows, each weight copy warm in L3, flipped between
    kernels from one process to the next on small weights, where in a model's forward the native
    kernel won at every width (docs/decisions.md, stop 49). Above, it is timed like FBGEMM."""
    import time
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).half().float()
    copies = min(64, max(2, -(-(16 << 20) // (4 * w.numel()))))
    fp32 = [w.t().contiguous() for _ in range(copies)]
    fp16 = [Fp16WeightLinear(w, kernel=kernel) for _ in range(copies)]
    floor = native.rows_per_pass() if fp16[0].kernel == "native" else 0
    times = {}
    with torch.inference_mode():
        for rows in (r for r in ROWS if r > floor):
            x = torch.randn(rows, in_features, generator=gen)
            n = copies if rows <= 8 else max(2, copies * 8 // rows)
            best = [float("inf"), float("inf")]
            for _ in range(5 if rows <= 64 else 3):
                for i, run in enumerate((lambda: [x @ wt for wt in fp32[:n]], lambda: [f(x) for f in fp16[:n]])):
                    t0 = time.perf_counter()
                    run()
                    best[i] = min(best[i], time.perf_counter() - t0)
            times[rows] = tuple(best)
            if crossover(times, floor) < rows:
                break
    return crossover(times, floor)


def cpu_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """The CPU module computing x @ weight.T + bias fastest on this machine that this weight
    admits (module docstring). weight: [out, in], float32 or not."""
    if weight.device.type == "cpu" and fp16_exact(weight) and fp16_gemm_works():
        kernel = fp16_kernel()
        rows = fp16_gemm_rows(*weight.shape, torch.get_num_threads(), kernel, native.pool_threads())
        if rows:         # won at every row count timed: every count (a prefill's, a wide verify's)
            return Fp16WeightLinear(weight, bias, max_rows=None if rows >= ROWS[-1] else rows, kernel=kernel)
    return PackedLinear(_linear(weight, bias))


def pack_linears_(module: nn.Module) -> None:
    """Replace every nn.Linear under `module` by its `cpu_linear` (in place), and give every
    RMSNorm and attention the C kernels where they build (pipeline.model.native), for a step's
    few rows; a decoder layer whose linears all run half_gemm becomes one C call
    (`native.layer_weights`)."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, cpu_linear(child.weight, child.bias))
        else:
            if isinstance(child, RMSNorm) and child.weight.device.type == "cpu":
                child.native = native.library()
            if isinstance(child, Attention) and next(child.parameters()).device.type == "cpu":
                child.native = native.library()
            pack_linears_(child)
    if isinstance(module, DecoderLayer):          # its linears packed now: the whole layer as one C call
        module.attach_native_()


def packing_pays(device: torch.device) -> bool:
    """Measured on CPU only (module docstring)."""
    return torch.device(device).type == "cpu"
