"""C kernels for a CPU step's few rows (half_gemm.c): a linear over float16-stored weights,
RMSNorm, and attention over the KV cache.

At batch 1 a CPU step's linears are bound by reading their weights, yet in torch's kernels
(MKL float32, FBGEMM float16) a linear over 6 rows cost 1.5-2.2x one row, so a speculative
step paid for its width. `half_gemm` reads each weight once for up to 6-8 rows and prefetches
ahead: on the demo's shapes (one thread, weights cycled out of L2) 6 rows cost 1.0-1.2x one
row, and 0.55-0.7x FBGEMM's time (docs/decisions.md, stop 49).

The source is compiled on first use with the machine's C compiler (`cc`, or $CC) for this CPU
(-march=native) into a cache folder ($SPECBATCH_CACHE, else ~/.cache/specbatch), keyed by the
source, the compiler and the CPU's flags; later processes load it (~1 s the first time). It
takes AVX-512 (16 lanes) or AVX2 with FMA and F16C (8 lanes), whichever the CPU has. Where there
is no compiler, neither instruction set, the build fails or the result disagrees with float64
math, `library()` is None and the engine keeps torch's kernels. SPECBATCH_NATIVE=0 switches it off;
SPECBATCH_NATIVE_ISA=avx2 builds the AVX2 kernels on an AVX-512 CPU (to compare the two, and so
the tests run both where the CPU has AVX-512).

`rms_norm` is one call where torch's float32 RMSNorm is ~10 small ops: at batch 1 a demo forward
runs 25 of them (docs/decisions.md, stop 49). `attend` is one call for a layer's RoPE, cache
write, mask and attention, ~15 torch ops: a demo step at batch 1 went from 4.4 to 2.8 ms with it
(docs/decisions.md, stop 50). `decoder_layer` is a whole layer, `decoder_stack` every layer of a
step (a call per layer cost ~10 us of Python each) and of a prefill, a few rows and positions a
call (pipeline/model/target.py), and the MTP heads' forward, fill and greedy drafting are calls
of their own.

Threads: the linears and attention split over a pool of threads (half_gemm.c `set_threads`),
which the engine sizes to torch's thread count while it works (`cpu_threads`, where torch's own
ops drop to one thread); outside it the kernels run on the calling thread. Results are the same
bits on any count. SPECBATCH_SPIN_NS sets how long idle workers spin before they sleep (2 ms).

Example: w [n, k] float32 that float16 holds; packed = pack(w); y = linear(x, packed, None, n)
equals x @ w.T up to float32 rounding.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pipeline.model import pages
from pipeline.spec_decode import rng
from pipeline.spec_decode.sampling import argmax_last

SOURCE = Path(__file__).with_name("half_gemm.c")
PANEL = 64                # output columns per panel (half_gemm.c)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-pthread"]
ISA_FLAGS = {"best": [], "avx2": ["-mno-avx512f"]}     # SPECBATCH_NATIVE_ISA -> extra flags


def isa() -> str:
    """The instruction set asked for: SPECBATCH_NATIVE_ISA ("best", the default: the widest the CPU
    has; "avx2": AVX2 even where the CPU has AVX-512)."""
    name = os.environ.get("SPECBATCH_NATIVE_ISA", "best") or "best"
    if name not in ISA_FLAGS:
        raise ValueError(f"SPECBATCH_NATIVE_ISA={name!r}: expected one of {sorted(ISA_FLAGS)}")
    return name


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("SPECBATCH_CACHE")
    if root:
        return Path(root)
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home) / "specbatch"


def build(cache: Path | None = None, isa_name: str | None = None, source: Path | None = None) -> Path | None:
    """The compiled library's path (compiled now unless cached), or None where it cannot be.
    isa_name: a key of ISA_FLAGS (default: `isa()`); source: another half_gemm.c (default
    SOURCE; benchmarks/step_costs.py --compare-source times an earlier commit's)."""
    flags = FLAGS + ISA_FLAGS[isa_name or isa()]
    source = source or SOURCE
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256("\0".join([source.read_text(), cc, version, " ".join(flags), _cpu_flags()]).encode())
    for folder in ([cache] if cache is not None else [_cache_dir(), Path(tempfile.gettempdir()) / "specbatch"]):
        path = folder / f"half_gemm-{key.hexdigest()[:16]}.so"
        if path.exists():
            return path
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError:
            continue                              # not writable: try the next folder
        try:
            done = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, timeout=120)
            if done.returncode != 0:
                return None                       # e.g. no AVX-512 (#error), an old compiler
            os.replace(tmp, path)                 # atomic: a concurrent process loads a whole file
            return path
        except (OSError, subprocess.SubprocessError):
            return None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return None


@functools.lru_cache(maxsize=1)
def library():
    """The loaded kernels (ctypes library: `half_gemm`, `rms_norm`, `attend`, `decoder_layer`,
    `mtp_forward`, `mtp_greedy`), or None (module docstring). `_agrees` checks the first two
    against float64 math at load; the others are tested against torch's path (tests/test_lean_step.py).
    Once per process."""
    if os.environ.get("SPECBATCH_NATIVE", "1") == "0":
        return None
    path = build()
    return None if path is None else load(path)


_pool_threads: int | None = None     # the C kernels' threads while `cpu_threads` holds, else None


def pool_threads() -> int:
    """Threads the C kernels run on now: the caller's alone, or inside `cpu_threads` torch's
    thread count as it was on entry."""
    return _pool_threads or 1


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def thread_count() -> int:
    """Threads the engine's CPU work has: torch's count, or inside `cpu_threads` the C kernels'
    (torch's own ops run on one thread there). What profiles are keyed by and benchmarks report."""
    return _pool_threads or torch.get_num_threads()


@contextlib.contextmanager
def cpu_threads():
    """While the engine works on CPU with the C kernels: torch's thread count T runs them (the
    caller and T - 1 workers of half_gemm.c's pool, splitting each linear's output panels and each
    attention's (row, kv head) pairs; results the same bits as on one thread) and torch's own ops
    run on one thread, so the two pools never wait on each other's spinning threads. With both
    on 2 threads a 32-row step took 1.6x its one-thread time; on the pool alone, 0.6x (2-core Zen
    4, docs/decisions.md, stop 54). T is restored on exit; the pool takes at most the CPUs this
    process may run on (its workers spin between a step's calls). A nested use, T = 1, no
    library: no change."""
    global _pool_threads
    lib = library()
    t = torch.get_num_threads()
    if lib is None or _pool_threads is not None or t <= 1 or not hasattr(lib, "set_threads"):
        yield
        return
    _pool_threads = lib.set_threads(min(t, _cpus()))
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(t)
        lib.set_threads(1)
        _pool_threads = None


def load(path: Path):
    """The library at `path` with its functions' signatures, or None where it does not load or
    disagrees with float64 math."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError:
        return None
    lib.half_gemm.restype = lib.rms_norm.restype = None
    lib.half_gemm_rows.restype = ctypes.c_int
    lib.half_gemm_rows.argtypes = []
    if hasattr(lib, "set_threads"):          # (an earlier commit's build has no pool)
        lib.set_threads.restype = ctypes.c_int
        lib.set_threads.argtypes = [ctypes.c_int]
    lib.half_gemm.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 4
    lib.rms_norm.argtypes = [ctypes.c_int] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_float, ctypes.c_void_p]
    lib.attend.restype = ctypes.c_int
    lib.attend.argtypes = ([ctypes.c_int] * 6 + [ctypes.c_void_p] * 8 + [ctypes.c_int] * 2
                           + [ctypes.c_float, ctypes.c_void_p])
    lib.decoder_layer.restype = ctypes.c_int
    lib.decoder_layer.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 8
                                  + [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 2
                                  + [ctypes.c_float, ctypes.c_void_p])
    if hasattr(lib, "decoder_stack"):        # (an earlier commit's build, step_costs --compare-source, has none)
        lib.decoder_stack.restype = ctypes.c_int
        lib.decoder_stack.argtypes = ([ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 7
                                      + [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
                                      + [ctypes.c_void_p] * 3)
    if hasattr(lib, "target_forward"):
        lib.target_forward.restype = ctypes.c_int
        lib.target_forward.argtypes = ([ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 5 + [ctypes.c_float]
                                       + [ctypes.c_void_p] * 4 + [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                                                                  ctypes.c_int] + [ctypes.c_void_p] * 4)
    if hasattr(lib, "exp_noise"):
        lib.exp_noise.restype = None
        lib.exp_noise.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_uint64] + [ctypes.c_void_p] * 4
    if hasattr(lib, "argmax_rows"):
        lib.argmax_rows.restype = None
        lib.argmax_rows.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    if hasattr(lib, "greedy_head"):
        lib.greedy_head.restype = None
        lib.greedy_head.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p] * 7
    lib.mtp_forward.restype = ctypes.c_int
    lib.mtp_forward.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 9
                                + [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int] * 2 + [ctypes.c_float, ctypes.c_void_p])
    lib.mtp_fill.restype = ctypes.c_int
    lib.mtp_fill.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 8 + [ctypes.c_int]
                             + [ctypes.c_void_p] + [ctypes.c_int] * 2 + [ctypes.c_float] + [ctypes.c_void_p] * 2)
    lib.mtp_greedy.restype = ctypes.c_int
    lib.mtp_greedy.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_float] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
                               + [ctypes.c_void_p] + [ctypes.c_int] * 3 + [ctypes.c_void_p] * 6 + [ctypes.c_int]
                               + [ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_void_p]
                               + [ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_uint64, ctypes.c_void_p])
    return lib if _agrees(lib) else None


def rows_per_pass() -> int:
    """Input rows half_gemm takes in one read of a weight: 8 with AVX-512, 6 with AVX2
    (half_gemm.c RB); 0 without the library."""
    lib = library()
    return lib.half_gemm_rows() if lib is not None else 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] float32 -> float16 panels [ceil(n / 64), k, 64], zero past n."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.float16)
    padded[:n] = weight.detach().to("cpu", torch.float16)
    out = pages.empty((panels, k, PANEL), torch.float16)      # streamed every step: on 2 MB pages
    out.copy_(padded.view(panels, PANEL, k).transpose(1, 2))
    return out


def pad_bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The bias as half_gemm reads it: a whole number of panels of float32, zero past n."""
    if bias is None:
        return None
    out = torch.zeros(-(-n // PANEL) * PANEL)
    out[:n] = bias.detach().float()
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, lib=None) -> torch.Tensor:
    """x [..., k] float32 on CPU -> [..., n]: x @ W.T (+ bias) for W packed by `pack`."""
    lib = lib or library()
    k = packed.shape[1]
    x2 = x.reshape(-1, k).contiguous().float()
    y = torch.empty(x2.shape[0], n)
    if x2.shape[0]:
        lib.half_gemm(x2.shape[0], k, n, x2.data_ptr(), packed.data_ptr(),
                      None if bias is None else bias.data_ptr(), y.data_ptr())
    return y.view(*x.shape[:-1], n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, lib=None) -> torch.Tensor:
    """x [..., d] float32 on CPU, weight [d] float32 -> weight * x / sqrt(mean(x^2) + eps), as
    F.rms_norm (another summation order)."""
    lib = lib or library()
    x = x.contiguous()
    y = torch.empty_like(x)
    d = x.shape[-1]
    if x.numel():
        lib.rms_norm(x.numel() // d, d, x.data_ptr(), weight.data_ptr(), eps, y.data_ptr())
    return y


def _attention_inputs(positions: torch.Tensor, rows: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                      valid: torch.Tensor | None):
    """The attention arguments as the C kernels read them: positions, rows, cos, sin contiguous,
    and valid with unit stride along keys plus its row stride (0 without one). The caller keeps
    the returned tensors while C reads them (a temporary's memory would go)."""
    positions, cos, sin = positions.contiguous(), cos.contiguous(), sin.contiguous()
    rows = None if rows is None else rows.contiguous()
    valid, stride = _valid_rows(valid)
    return positions, rows, cos, sin, valid, stride


def _valid_rows(valid: torch.Tensor | None):
    """(valid with unit stride along keys, its row stride), or (None, 0)."""
    if valid is None:
        return None, 0
    if valid.stride(-1) != 1:
        valid = valid.contiguous()
    return valid, valid.stride(0)


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
           rows: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
           valid: torch.Tensor | None, window: int | None, num_heads: int, lib=None) -> torch.Tensor:
    """One attention layer over a per-row KV cache (half_gemm.c `attend`): RoPE on q and k, k and v
    written into the cache at `positions`, each query attending its row's keys up to its position.
    qkv [n, q, (hq + 2 hk) * d] float32; cos, sin (folded) [n, q, d]; positions [n, q]; rows [n]
    cache rows (None: 0..n-1); k_cache, v_cache: one layer's [B, hk, T, d] float32, contiguous;
    valid: None or bool [n, >= kv_len] keys that may be attended (besides the query's own).
    Returns [n, q, hq * d], as SDPA over pipeline.model.cache.Batch.mask would (another summation
    order)."""
    lib = lib or library()
    n, q = positions.shape
    _, hk, cap, d = k_cache.shape
    out = qkv.new_empty(n, q, num_heads * d)
    if n and q:
        positions, rows, cos, sin, valid, stride = _attention_inputs(positions, rows, cos, sin, valid)
        status = lib.attend(n, q, num_heads, hk, d, cap, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), _ptr(rows),
                            positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _ptr(valid), stride,
                            window or 0, d ** -0.5, out.data_ptr())
        if status:
            raise MemoryError("attend: no memory for its scratch")
    return out


class LayerWeights(ctypes.Structure):
    """A decoder layer's sizes and weight pointers as half_gemm.c's `Layer` reads them."""
    _fields_ = ([(f, ctypes.c_int) for f in ("hidden", "hq", "hk", "d", "inter")]
                + [("eps_in", ctypes.c_float), ("eps_post", ctypes.c_float)]
                + [(f, ctypes.c_void_p) for f in ("norm_in", "norm_post", "qkv", "o", "gate_up", "down",
                                                  "qkv_b", "o_b", "gate_up_b", "down_b")])


class NativeLayer:
    """A DecoderLayer as one C call (`decoder_layer`) for forwards of up to `max_tokens` tokens
    (None: any a step has, `layers.NATIVE_ATTN_TOKENS`): its weights' pointers (the module keeps
    the tensors alive), its attention window and the scratch size per token.
    `layer_weights` sets no cap from its linears' GEMM crossovers (`packed.fp16_gemm_rows`): that
    timing pits one GEMM against MKL's and is drawn anew in each process, while past a cap the
    whole layer ran torch's modules, slower than the C layer at every step width measured
    (docs/decisions.md, stop 63)."""

    def __init__(self, weights: LayerWeights, max_tokens: int | None, scratch: int, window: int | None, lib):
        self.weights, self.max_tokens, self.scratch, self.window, self.lib = weights, max_tokens, scratch, window, lib
        self.ref = ctypes.byref(weights)
        self.scale = weights.d ** -0.5


def layer_weights(layer) -> NativeLayer | None:
    """The C form of `layer` (a pipeline.model.layers.DecoderLayer, fused and packed), or None
    where one of its parts is not what decoder_layer computes: q/k norms, an unfused projection,
    a linear not on the native float16 GEMM, a norm not in float32, or no library."""
    lib = library()
    attn, mlp = layer.self_attn, layer.mlp
    if lib is None or not (attn.fused and mlp.fused) or attn.qk_norm:
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(getattr(m, "kernel", None) == "native" for m in linears):
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(n.weight.dtype == torch.float32 and n.weight.is_contiguous() for n in norms):
        return None
    w = LayerWeights(attn.o_proj.out_features, attn.num_heads, attn.num_kv_heads, attn.head_dim,
                     mlp.down_proj.in_features, norms[0].eps, norms[1].eps, norms[0].weight.data_ptr(),
                     norms[1].weight.data_ptr(), *(m._ptrs[0] for m in linears), *(m._ptrs[1] for m in linears))
    hq_d, qkv_d = attn.num_heads * attn.head_dim, (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim
    return NativeLayer(w, None, w.hidden + qkv_d + hq_d + 3 * w.inter, attn.window, lib)


def decoder_layer(native_layer: NativeLayer, x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None,
                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  valid: torch.Tensor | None) -> torch.Tensor:
    """DecoderLayer.block in one C call: x [n, q, hidden] float32 -> [n, q, hidden]; the other
    arguments as `attend`'s (k_cache, v_cache: the layer's [B, hk, T, d])."""
    n, q = positions.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    scratch = torch.empty(n * q * native_layer.scratch)
    positions, rows, cos, sin, valid, stride = _attention_inputs(positions, rows, cos, sin, valid)
    status = native_layer.lib.decoder_layer(
        native_layer.ref, n, q, x.data_ptr(), y.data_ptr(), cos.data_ptr(), sin.data_ptr(), _ptr(rows),
        positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[2], _ptr(valid), stride,
        native_layer.window or 0, native_layer.scale, scratch.data_ptr())
    if status:
        raise MemoryError("decoder_layer: no memory for attention's scratch")
    return y


class NativeStack:
    """A target's decoder layers as one C call (`decoder_stack`): their `NativeLayer`s (kept
    alive), the array of their weights' pointers, each one's attention window and scale, the
    most tokens all take and the largest scratch per token."""

    def __init__(self, layers: list[NativeLayer]):
        self.layers, self.lib, k = layers, layers[0].lib, len(layers)
        self.refs = (ctypes.c_void_p * k)(*(ctypes.addressof(nl.weights) for nl in layers))
        self.windows = (ctypes.c_int * k)(*(nl.window or 0 for nl in layers))
        self.scales = (ctypes.c_float * k)(*(nl.scale for nl in layers))
        caps = [nl.max_tokens for nl in layers if nl.max_tokens is not None]
        self.max_tokens = min(caps) if caps else None
        self.scratch = max(nl.scratch for nl in layers)


def stack_weights(layers: list) -> NativeStack | None:
    """The C form of decoder layers `layers` together (each's `native_layer`), or None where one
    has none, they were built against different libraries or the library has no `decoder_stack`."""
    nls = [layer.native_layer for layer in layers]
    if not nls or any(nl is None for nl in nls) or len({id(nl.lib) for nl in nls}) > 1:
        return None
    if not hasattr(nls[0].lib, "decoder_stack"):
        return None
    return NativeStack(nls)


def decoder_stack(stack: NativeStack, x: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None,
                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  valid: torch.Tensor | None) -> torch.Tensor:
    """Every layer's DecoderLayer.block in one C call, as `decoder_layer` one after another: x [n,
    q, hidden] float32 -> [n, q, hidden]; k_cache, v_cache: the whole cache's [layers, B, hk, T, d]
    (contiguous); the other arguments as `attend`'s."""
    n, q = positions.shape
    y = x.contiguous().clone()
    scratch = torch.empty(n * q * stack.scratch)
    positions, rows, cos, sin, valid, stride = _attention_inputs(positions, rows, cos, sin, valid)
    status = stack.lib.decoder_stack(
        stack.refs, len(stack.layers), n, q, y.data_ptr(), cos.data_ptr(), sin.data_ptr(), _ptr(rows),
        positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.shape[3],
        _ptr(valid), stride, stack.windows, stack.scales, scratch.data_ptr())
    if status:
        raise MemoryError("decoder_stack: no memory for attention's scratch")
    return y


def target_forward(stack: NativeStack, ids: torch.Tensor, table: torch.Tensor, cos_t: torch.Tensor,
                   sin_t: torch.Tensor, norm: tuple[torch.Tensor, float] | None, positions: torch.Tensor,
                   rows: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   valid: torch.Tensor | None) -> torch.Tensor:
    """The embedding of token ids [n, q] (table [V, hidden] float32, contiguous), `decoder_stack`
    at `positions` with the rotary rows of tables cos_t, sin_t [> max position, head_dim] (sin
    folded, contiguous), then `norm` (its weight and eps; None: none), in one C call -> [n, q,
    hidden]: TargetModel.forward's values with one call where it made ~10 small torch calls."""
    n, q = positions.shape
    hidden, d = table.shape[1], cos_t.shape[1]
    y = torch.empty(n, q, hidden)
    scratch = torch.empty(n * q * (hidden + 2 * d + stack.scratch))
    ids = ids.contiguous()
    positions, rows, cos_t, sin_t, valid, stride = _attention_inputs(positions, rows, cos_t, sin_t, valid)
    weight, eps = norm if norm is not None else (None, 0.0)
    status = stack.lib.target_forward(
        stack.refs, len(stack.layers), n, q, hidden, ids.data_ptr(), table.data_ptr(), cos_t.data_ptr(),
        sin_t.data_ptr(), _ptr(weight), eps, _ptr(rows), positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.shape[3], _ptr(valid), stride, stack.windows, stack.scales, y.data_ptr(),
        scratch.data_ptr())
    if status:
        raise MemoryError("target_forward: no memory for attention's scratch")
    return y


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) (the first index of the largest value; of the first NaN where a row has
    one) for float32 x [..., V] on CPU, rows split across the C pool (half_gemm.c `argmax_rows`);
    elsewhere sampling.argmax_last. Greedy decoding's pick: at 32 rows of 6,144 logits on one
    torch thread the blocked torch argmax took ~0.25 ms, 5% of a step."""
    lib = library()
    if x.device.type != "cpu" or x.dtype != torch.float32 or lib is None or not hasattr(lib, "argmax_rows"):
        return argmax_last(x)
    v = x.shape[-1]
    rows = x.reshape(-1, v).contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.long)
    if rows.shape[0] and v:
        lib.argmax_rows(rows.shape[0], v, rows.data_ptr(), out.data_ptr())
    elif rows.shape[0]:
        return argmax_last(x)                     # (no values: torch's own error)
    return out.view(x.shape[:-1])


def greedy_head(linear, hidden: torch.Tensor, drafts: torch.Tensor, lib=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A greedy verify's acceptance from its final hidden states [n, G + 1, k] (float32, CPU) in
    one C call (half_gemm.c `greedy_head`): the output linear `linear` (an Fp16WeightLinear on the
    C GEMM), the argmax at each position (`argmax`'s rule) and the drafts [n, G] kept. Returns
    (num_accepted [n], emitted [n, G + 1]) as `greedy_accept` over `linear`'s logits does, or
    None where the C path does not take it (torch's kernel, too many rows, no such function)."""
    lib = lib or library()
    n, q, k = hidden.shape
    if (lib is None or not hasattr(lib, "greedy_head") or getattr(linear, "kernel", None) != "native"
            or hidden.dtype != torch.float32 or hidden.device.type != "cpu" or drafts.shape != (n, q - 1)
            or drafts.dtype != torch.long
            or (linear.max_rows is not None and n * q > linear.max_rows)):
        return None
    hidden, drafts = hidden.contiguous(), drafts.contiguous()
    emitted = torch.empty(n, q, dtype=torch.long)
    accepted = torch.empty(n, dtype=torch.long)
    logits = torch.empty(n * q * linear.out_features)
    lib.greedy_head(n, q, k, linear.out_features, hidden.data_ptr(), *linear._ptrs, drafts.data_ptr(),
                    emitted.data_ptr(), accepted.data_ptr(), logits.data_ptr())
    return accepted, emitted


C_NOISE = True       # False: exponential_noise is torch's (rng.exponential_noise), for comparisons
C_DRAFT_PICKS = True  # False: coupled drafts are picked in torch (the engine's pick), for comparisons


def exponential_noise(seed: int, row_keys: torch.Tensor, positions: torch.Tensor, vocab: int,
                      tokens: torch.Tensor | None = None) -> torch.Tensor:
    """rng.exponential_noise (coupled sampling's Exp(1) noise of every token, or of `tokens`) as
    one C call on CPU, rows split across the pool (half_gemm.c `exp_noise`): the same integers
    and uniforms, -log(u) within one float32 ulp of torch's. torch's ~20 passes took 0.34 ms for
    one row of 6,144 tokens and 1.4 ms for 32 on one thread, a quarter of a sampled plain step
    at batch 1. Elsewhere, or without the library, rng's own. A process takes one of the two for
    all its noise (the engine passes this one to pipeline.engine.coupled), so a draft and the
    target always see the same noise."""
    lib = library()
    if positions.device.type != "cpu" or lib is None or not hasattr(lib, "exp_noise") or not C_NOISE:
        return rng.exponential_noise(seed, row_keys, positions, vocab, tokens)
    pos = positions.to(torch.int64).reshape(-1).contiguous()                           # [r]
    r = pos.numel()
    keys = row_keys.to(torch.int64).view(-1, *([1] * (positions.dim() - 1))).expand(positions.shape).contiguous()
    if tokens is None:
        ids, m, out = None, vocab, torch.empty(*positions.shape, vocab)
    else:
        ids = tokens.to(torch.int64).reshape(r, -1).contiguous()
        m, out = ids.shape[1], torch.empty(tokens.shape)
    if r and m:
        lib.exp_noise(r, m, rng.stream_word(seed, rng.NOISE), keys.data_ptr(), pos.data_ptr(),
                      _ptr(ids), out.data_ptr())
    return out


class MtpInput(ctypes.Structure):
    """An MTP head's input projection as half_gemm.c's `MtpInput` reads it."""
    _fields_ = [("hidden", ctypes.c_int), ("eps_e", ctypes.c_float), ("eps_h", ctypes.c_float)] + [
        (f, ctypes.c_void_p) for f in ("table", "enorm", "hnorm", "eh", "eh_b")]


class NativeHead:
    """An MTP head's forward as one C call (`mtp_forward`): its input projection's pointers, its
    layer's (`NativeLayer`), up to `max_tokens` tokens (its layer's cap)."""

    def __init__(self, weights: MtpInput, layer: NativeLayer):
        self.weights, self.layer = weights, layer
        self.ref = ctypes.byref(weights)
        self.scratch = 3 * weights.hidden + layer.scratch

    @property
    def max_tokens(self) -> int | None:
        return self.layer.max_tokens


def head_weights(head, table: torch.Tensor) -> NativeHead | None:
    """The C form of MTP head `head` (pipeline.model.mtp.MTPHead, its layer already C:
    `native_layer`) with token embedding `table` [V, hidden], or None where its input
    projection is not on the native float16 GEMM or a weight is not contiguous float32."""
    layer, eh = head.native_layer, head.eh_proj
    if layer is None or getattr(eh, "kernel", None) != "native":
        return None
    parts = (table, head.enorm.weight, head.hnorm.weight)
    if not all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in parts):
        return None
    w = MtpInput(table.shape[1], head.enorm.eps, head.hnorm.eps, *(t.data_ptr() for t in parts), *eh._ptrs)
    return NativeHead(w, layer)


def mtp_forward(native_head: NativeHead, prev: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor,
                rows: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """MTPHead.forward in one C call: prev [n, q, hidden] float32, ids [n, q] -> [n, q, hidden];
    the other arguments as `decoder_layer`'s."""
    n, q = positions.shape
    layer = native_head.layer
    prev, ids = prev.contiguous(), ids.contiguous()
    y = torch.empty_like(prev)
    scratch = torch.empty(n * q * native_head.scratch)
    positions, rows, cos, sin, valid, stride = _attention_inputs(positions, rows, cos, sin, valid)
    status = layer.lib.mtp_forward(
        native_head.ref, layer.ref, n, q, ids.data_ptr(), prev.data_ptr(), y.data_ptr(), cos.data_ptr(),
        sin.data_ptr(), _ptr(rows), positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[2],
        _ptr(valid), stride, layer.window or 0, layer.scale, scratch.data_ptr())
    if status:
        raise MemoryError("mtp_forward: no memory for attention's scratch")
    return y


def mtp_fill(native_head: NativeHead, start: torch.Tensor, count: torch.Tensor, ids: torch.Tensor,
             hidden: torch.Tensor, cos_t: torch.Tensor, sin_t: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, valid: torch.Tensor, carry: torch.Tensor) -> None:
    """One head's fill of rows 0..r-1 (half_gemm.c `mtp_fill`): start, count [r] int64; ids [r, w];
    hidden [r, w, hidden] float32; cos_t, sin_t: rotary tables by position covering every
    position; valid: the head's key mask rows [r, T] (bool, unit stride along keys; written);
    carry [r, hidden] float32 contiguous (written: each row's output at its last real entry)."""
    r, w = ids.shape
    layer = native_head.layer
    assert valid.stride(-1) == 1 and carry.is_contiguous()      # both are written in place
    start, count, ids, hidden = start.contiguous(), count.contiguous(), ids.contiguous(), hidden.contiguous()
    scratch = torch.empty(r * w * (2 * layer.weights.d + native_head.weights.hidden + native_head.scratch))
    status = layer.lib.mtp_fill(
        native_head.ref, layer.ref, r, w, start.data_ptr(), count.data_ptr(), ids.data_ptr(), hidden.data_ptr(),
        cos_t.data_ptr(), sin_t.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[2],
        valid.data_ptr(), valid.stride(0), layer.window or 0, layer.scale, carry.data_ptr(), scratch.data_ptr())
    if status:
        raise MemoryError("mtp_fill: no memory for its positions or attention's scratch")


class NativeDraft:
    """An MTP head's greedy drafting in C (`mtp_greedy`): its forward (`NativeHead`) and its
    output: norm weight and eps, the output linear's packed weight (its draft vocabulary's rows,
    or the whole head) with `ids` mapping its rows to token ids (None: row = token id)."""

    def __init__(self, head: NativeHead, norm, linear, ids: torch.Tensor | None):
        self.head, self.norm, self.linear = head, norm, linear
        self.ids = None if ids is None else ids.to(torch.long).contiguous()
        self.vout = linear.out_features
        layer = head.layer.weights
        self.scratch = 2 * layer.d + 2 * layer.hidden + self.vout + head.scratch

    @property
    def max_tokens(self) -> int | None:
        """Rows up to which the C path runs: its head's (its layer's) cap."""
        return self.head.max_tokens


def draft_weights(head) -> NativeDraft | None:
    """The C greedy drafting of MTP head `head` (its forward C: `native_head`), or None where its
    output linear is not on the native float16 GEMM or its norm is not float32."""
    nh = head.native_head
    linear = head.draft_head if head.draft_ids is not None else head.shared_head.head
    if linear is None and head.draft_ids is None:
        target = head._target
        linear = target.lm_head if target.lm_head is not None else target.tied_head
    norm = head.shared_head.norm
    if nh is None or getattr(linear, "kernel", None) != "native" or norm.weight.dtype != torch.float32:
        return None
    return NativeDraft(nh, norm, linear, head.draft_ids)


def mtp_greedy(nd: NativeDraft, n: int, first: int, last: int, h: torch.Tensor, lengths: torch.Tensor,
               cos_t: torch.Tensor, sin_t: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               valid: torch.Tensor | None, tokens: torch.Tensor, drafts_from: int = 0, drafts_to: int = -1,
               coupled: tuple[float, int, torch.Tensor] | None = None) -> None:
    """Greedy drafts at depths first..last of one head into tokens[:, first - 1:last] (tokens
    [n, G] int64 contiguous, depth first - 1's draft in the column before where first >= 2);
    h [n, hidden] float32 contiguous: the hidden state at depth `first`, overwritten. cos_t,
    sin_t: rotary tables by position; valid: the head's filled keys [n, >= T] (bool), and
    each row's keys lengths + drafts_from .. lengths + drafts_to (this step's drafts) visible
    besides (Drafter._visible's mask; the default range is empty).
    coupled (temperature, seed, row keys [n]): coupled sampling's picks instead of the argmax,
    over `exponential_noise`'s values (depth j's draft keyed at position lengths + j)."""
    layer = nd.head.layer
    lengths = lengths.contiguous()
    valid, stride = _valid_rows(valid)
    scratch = torch.empty(n * nd.scratch)
    w_ptr, b_ptr = nd.linear._ptrs
    temperature, word, keys = 0.0, 0, None
    if coupled is not None:
        temperature, word, keys = coupled[0], rng.stream_word(coupled[1], rng.NOISE), coupled[2]
        keys = keys.to(torch.int64).contiguous()                 # bound: the call reads its memory
    status = layer.lib.mtp_greedy(
        nd.head.ref, layer.ref, nd.norm.weight.data_ptr(), nd.norm.eps, w_ptr, b_ptr, nd.vout, _ptr(nd.ids), n,
        first, last, h.data_ptr(), lengths.data_ptr(), cos_t.data_ptr(), sin_t.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), k_cache.shape[2], _ptr(valid), stride, drafts_from, drafts_to, layer.window or 0, layer.scale,
        tokens.data_ptr() + (first - 1) * tokens.element_size(), tokens.stride(0), scratch.data_ptr(),
        temperature, word, _ptr(keys))
    if status:
        raise MemoryError("mtp_greedy: no memory for its key mask or attention's scratch")


def _agrees(lib) -> bool:
    """The built kernels against float64 math on odd shapes (a partial panel, 1-13 rows, a bias;
    a norm of 70)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(100, 70, generator=gen).half().float()
    b = torch.randn(100, generator=gen)
    packed, padded = pack(w), pad_bias(b, 100)
    for m in (1, 6, 13):
        x = torch.randn(m, 70, generator=gen)
        ref = x.double() @ w.double().t() + b.double()
        if not torch.allclose(linear(x, packed, padded, 100, lib).double(), ref, rtol=1e-5, atol=1e-4):
            return False
        g = torch.randn(70, generator=gen)
        ref = g.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
        if not torch.allclose(rms_norm(x, g, 1e-6, lib).double(), ref, rtol=1e-5, atol=1e-5):
            return False
    return True
