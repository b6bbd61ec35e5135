"""The lean verify step: packed ([in, out]) linears compute what the checkpoint's linears do,
the loader packs on CPU only for inference, and the step-cost harness reports every shape."""
import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.bench.step_costs import measure, table
from pipeline.engine import Engine
from pipeline.model.loader import load_model
from pipeline.model.packed import PackedLinear
from tests.tiny_models import tiny_checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    for shape in [(1, 48), (3, 5, 48), (7, 1, 48)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(packed(x), linear(x))


@pytest.mark.parametrize("tied", [False, True])
def test_loader_packs_for_inference_only(root, tied):
    path = tiny_checkpoint(root, arch="qwen2", num_mtp_layers=1, with_tokenizer=False, tie_word_embeddings=tied)
    plain = load_model(path)                                   # training / saving: checkpoint names
    fused = load_model(path, fuse=True)                        # inference on CPU: packed
    assert not any(isinstance(m, PackedLinear) for m in plain.target.modules())
    assert any(isinstance(m, PackedLinear) for m in fused.target.modules())
    assert any(isinstance(m, PackedLinear) for m in fused.heads[0].modules())
    assert (fused.target.tied_head is not None) == tied
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        h_plain, h_fused = plain.target.forward_full(ids), fused.target.forward_full(ids)
        torch.testing.assert_close(h_fused, h_plain)
        torch.testing.assert_close(fused.target.logits(h_fused), plain.target.logits(h_plain))
        nxt = torch.randint(0, 128, (2, 9))
        torch.testing.assert_close(fused.heads[0].logits(fused.heads[0].forward_full(h_fused, nxt)),
                                   plain.heads[0].logits(plain.heads[0].forward_full(h_plain, nxt)))


def test_step_costs_reports_every_shape(root):
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu")
    costs = measure(engine, rows=2, ctx=16, q_max=3, reps=2, draft_gammas=(1, 3))
    assert sorted(costs.verify_s) == [1, 2, 3] and sorted(costs.draft_s) == [1, 3]
    assert all(t > 0 for t in [*costs.verify_s.values(), *costs.draft_s.values()])
    assert costs.verify_ratio(1) == 1.0
    assert costs.depth_s() == pytest.approx((costs.draft_s[3] - costs.draft_s[1]) / 2)
    lines = table([costs]).splitlines()
    assert len(lines) == 3 and lines[2].startswith("| 2 | 16 |")


def test_step_split_reaches_the_shard_stats_row(root):
    """draft, verify and host time of every step, summed into the stats row's three columns."""
    from pipeline.cluster.worker import generate_group
    from pipeline.data.outputs import STATS_SCHEMA, stats_table
    from pipeline.engine import SamplingParams

    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=1, draftable=0.1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    _, measured, _ = generate_group(engine, prompts, [0, 1, 2], SamplingParams(max_new_tokens=8), 2,
                                    {"device": "cpu", "threads": 1})
    steps = engine.last_stats.steps
    assert steps and all(s.overhead_s > 0 and s.verify_s > 0 and s.draft_s > 0 for s in steps)
    assert measured["host_time_s"] == pytest.approx(sum(s.overhead_s for s in steps))
    assert measured["draft_time_s"] == pytest.approx(sum(s.draft_s for s in steps))
    assert "host_time_s" in STATS_SCHEMA.names
    row = stats_table([measured]).to_pylist()[0]
    assert row["host_time_s"] == pytest.approx(measured["host_time_s"])


def _kernel_or_skip(kernel):
    from pipeline.model import native
    if kernel == "native" and native.library() is None:
        pytest.skip("the native half_gemm does not build on this machine")
    if kernel == "fbgemm" and not hasattr(torch.ops.aten, "fbgemm_linear_fp16_weight"):
        pytest.skip("this torch build has no FBGEMM float16-weight GEMM")


@pytest.fixture(scope="module", params=["best", "avx2"])
def kernels(request, tmp_path_factory):
    """The C kernels under test: the library the engine loads, and its AVX2 build where this CPU
    has AVX-512 (SPECBATCH_NATIVE_ISA=avx2), so both vector paths of half_gemm.c run here."""
    from pipeline.model import native
    _kernel_or_skip("native")
    if request.param == "best":
        return native.library()
    if native.rows_per_pass() != 8:
        pytest.skip("this CPU has no AVX-512: the library is the AVX2 build already")
    lib = native.load(native.build(tmp_path_factory.mktemp("avx2"), "avx2"))
    assert lib is not None and lib.half_gemm_rows() == 6
    return lib


def test_native_isa_names_the_instruction_set_or_fails(monkeypatch):
    """SPECBATCH_NATIVE_ISA picks the build's flags; a name it does not know is an error, not a
    silent default."""
    from pipeline.model import native
    monkeypatch.delenv("SPECBATCH_NATIVE_ISA", raising=False)
    assert native.isa() == "best"
    monkeypatch.setenv("SPECBATCH_NATIVE_ISA", "avx2")
    assert native.isa() == "avx2" and "-mno-avx512f" in native.ISA_FLAGS["avx2"]
    monkeypatch.setenv("SPECBATCH_NATIVE_ISA", "avx3")
    with pytest.raises(ValueError, match="avx3"):
        native.isa()


@pytest.mark.parametrize("kernel", ["fbgemm", "native"])
@pytest.mark.parametrize("bias", [False, True])
def test_fp16_weight_linear_matches_linear(bias, kernel):
    """A float16-weight GEMM computes a float32 linear whose weights float16 holds, to float32
    rounding, for any leading shape, no rows and strided inputs."""
    from pipeline.model.packed import Fp16WeightLinear
    _kernel_or_skip(kernel)
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(linear.weight.half().float())
    fast = Fp16WeightLinear(linear.weight, linear.bias, kernel=kernel)
    for x in [torch.randn(1, 48), torch.randn(3, 5, 48), torch.randn(0, 48), torch.randn(48, 6).t()]:
        torch.testing.assert_close(fast(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_native_half_gemm_is_the_float32_linear_at_every_row_count_and_panel_edge(bias, kernels):
    """half_gemm against float64 math: outputs that fill no panel, one, and a panel and a bit
    (64 columns a panel), and 1-17 rows (passes of 8 with AVX-512, 6 with AVX2, and a rest)."""
    from pipeline.model import native
    gen = torch.Generator().manual_seed(0)
    for n, k in [(5, 3), (64, 32), (130, 40)]:
        w = torch.randn(n, k, generator=gen).half().float()
        b = torch.randn(n, generator=gen) if bias else None
        packed, padded = native.pack(w), native.pad_bias(b, n)
        for m in range(1, 18):
            x = torch.randn(m, k, generator=gen)
            want = x.double() @ w.double().t() + (0 if b is None else b.double())
            torch.testing.assert_close(native.linear(x, packed, padded, n, kernels).double(), want, rtol=1e-5, atol=1e-5)


def test_native_half_gemm_builds_once_per_source_and_machine(tmp_path, monkeypatch):
    """The library is compiled into the cache folder once; a second build loads that file."""
    import subprocess

    from pipeline.model import native
    _kernel_or_skip("native")
    compiles = []
    run = subprocess.run

    def counted(cmd, **kw):
        if "-o" in cmd:
            compiles.append(cmd)
        return run(cmd, **kw)
    monkeypatch.setattr(native.subprocess, "run", counted)
    first = native.build(tmp_path)
    assert first is not None and first.parent == tmp_path and len(compiles) == 1
    assert native.build(tmp_path) == first and len(compiles) == 1
    assert [p.name for p in tmp_path.iterdir()] == [first.name]       # no temporary left behind


def test_native_rms_norm_is_rms_norm_for_few_rows_and_leaves_autograd_to_torch(kernels):
    """The C RMSNorm against float64 math (widths that fill no vector, one, several and a bit);
    an RMSNorm given it matches torch's to float32 rounding, and an input that needs a gradient
    (training a head) takes torch's op."""
    from pipeline.model import native
    from pipeline.model.layers import NATIVE_NORM_ROWS, RMSNorm
    _kernel_or_skip("native")
    gen = torch.Generator().manual_seed(0)
    for d in (5, 16, 70, 256):
        x, w = torch.randn(3, 4, d, generator=gen), torch.randn(d, generator=gen)
        want = w.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
        torch.testing.assert_close(native.rms_norm(x, w, 1e-5, kernels).double(), want, rtol=1e-5, atol=1e-5)
    norm = RMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.normal_(generator=gen)
    calls = []
    norm.native = type("Spy", (), {"rms_norm": lambda self, *a: calls.append(a[0]) or native.library().rms_norm(*a)})()
    for rows in (1, 6, NATIVE_NORM_ROWS, NATIVE_NORM_ROWS + 1):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(norm.forward(x), F.rms_norm(x, (64,), norm.weight, 1e-6), rtol=1e-5, atol=1e-6)
    assert calls == [1, 6, NATIVE_NORM_ROWS]              # past a step's rows, torch's op
    x = torch.randn(2, 64, requires_grad=True)
    norm.forward(x).sum().backward()
    assert x.grad is not None and calls == [1, 6, NATIVE_NORM_ROWS]


def test_without_the_native_kernel_the_fp16_linears_take_fbgemm(monkeypatch):
    """SPECBATCH_NATIVE=0 (or no compiler, neither AVX-512 nor AVX2) leaves torch's kernels."""
    from pipeline.model import native, packed
    monkeypatch.setenv("SPECBATCH_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert native.library() is None and packed.fp16_kernel() == "fbgemm"
        w = torch.randn(16, 8).half().float()
        assert packed.Fp16WeightLinear(w).kernel == "fbgemm"
    finally:
        monkeypatch.delenv("SPECBATCH_NATIVE")
        native.library.cache_clear()


def test_the_native_kernel_is_taken_at_any_torch_thread_count():
    """The engine runs half_gemm on torch's thread count (native.cpu_threads), so the linears
    take it on one thread or several."""
    from pipeline.model import packed
    _kernel_or_skip("native")
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            assert packed.fp16_kernel() == "native"
    finally:
        torch.set_num_threads(threads)


def test_cpu_threads_gives_the_c_kernels_torchs_threads_and_torch_one(monkeypatch):
    """Inside the engine's context torch's own ops run on one thread and the C kernels on the
    count torch had, at most the process's CPUs; a nested context changes nothing; on exit torch
    has its count back."""
    from pipeline.model import native
    _kernel_or_skip("native")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        monkeypatch.setattr(native, "_cpus", lambda: 8)
        with native.cpu_threads():
            assert (torch.get_num_threads(), native.pool_threads(), native.thread_count()) == (1, 3, 3)
            with native.cpu_threads():
                assert (torch.get_num_threads(), native.pool_threads()) == (1, 3)
            assert native.pool_threads() == 3
        assert (torch.get_num_threads(), native.pool_threads(), native.thread_count()) == (3, 1, 3)
        monkeypatch.setattr(native, "_cpus", lambda: 2)
        with native.cpu_threads():
            assert (torch.get_num_threads(), native.pool_threads()) == (1, 2)
        torch.set_num_threads(1)
        with native.cpu_threads():
            assert (torch.get_num_threads(), native.pool_threads()) == (1, 1)
    finally:
        torch.set_num_threads(threads)


class _Pool:
    """`lib`'s thread pool at `threads` while held (half_gemm.c set_threads), one thread after."""

    def __init__(self, lib, threads):
        self.lib, self.threads = lib, threads

    def __enter__(self):
        assert self.lib.set_threads(self.threads) == self.threads
        return self

    def __exit__(self, *exc):
        self.lib.set_threads(1)


@pytest.mark.parametrize("threads", [2, 3])
def test_the_c_kernels_give_one_threads_bits_on_several(threads, kernels):
    """half_gemm split by output panels and attention by (row, kv head) over a pool of threads:
    the same bits as on one thread, at panel edges, rows past a pass, cache rows out of order and
    a packed verify's rows that share a cache row (each token attends the one before it)."""
    from pipeline.model import native
    from pipeline.model.layers import fold_sin
    gen = torch.Generator().manual_seed(threads)
    for m, k, n in [(1, 256, 1536), (3, 768, 256), (9, 256, 1000), (20, 64, 6144)]:
        w = torch.randn(n, k, generator=gen).half().float()
        packed, x = native.pack(w), torch.randn(m, k, generator=gen)
        one = native.linear(x, packed, None, n, kernels)
        with _Pool(kernels, threads):
            assert torch.equal(native.linear(x, packed, None, n, kernels), one)
    hq, hk, d = 8, 4, 32
    cases = [(torch.tensor([4, 0, 2]), torch.arange(30, 34)[None].expand(3, 4)),        # rows out of order
             (torch.tensor([1, 1, 1, 5]), torch.tensor([[20], [21], [22], [9]]))]       # packed: one row's tokens
    for rows, positions in cases:
        n, q = positions.shape
        qkv = torch.randn(n, q, (hq + 2 * hk) * d, generator=gen)
        angles = torch.randn(n, q, d, generator=gen)
        cos, sin = angles.cos(), fold_sin(angles.sin())
        valid = torch.rand(n, 40, generator=gen) > 0.2
        caches = torch.randn(6, hk, 48, d, generator=gen), torch.randn(6, hk, 48, d, generator=gen)
        outs = []
        for pool in (1, threads):
            k_cache, v_cache = caches[0].clone(), caches[1].clone()
            with _Pool(kernels, pool):
                outs.append((native.attend(qkv, cos, sin, positions, rows, k_cache, v_cache, valid, None, hq, kernels),
                             k_cache, v_cache))
        assert all(torch.equal(a, b) for a, b in zip(*outs))


def _c_argmax(lib, x):
    out = torch.empty(x.shape[0], dtype=torch.long)
    lib.argmax_rows(x.shape[0], x.shape[1], x.contiguous().data_ptr(), out.data_ptr())
    return out


@pytest.mark.parametrize("threads", [1, 3])
def test_the_c_argmax_is_torchs_on_ties_nans_and_infinities(threads, kernels):
    """half_gemm.c `argmax_rows` (greedy decoding's pick, native.argmax) gives torch.argmax's
    index: the first of equal largest values, the first NaN where a row has one, infinities and
    all -inf rows, rows not a whole number of vectors long, rows split over a pool."""
    from pipeline.model import native
    gen = torch.Generator().manual_seed(11)
    odd = torch.randn(9, 6144 + 5, generator=gen)
    odd[0, 40] = odd[0, 4000] = 9.0                           # a tie: the first
    odd[1, 4001] = odd[1, 77] = float("nan")                  # NaNs: the first
    odd[2, 6146] = float("inf")                               # in the tail past the vectors
    odd[3] = float("-inf")
    odd[4, 2], odd[4, 5000] = float("inf"), float("inf")
    odd[5] = 0.0
    odd[5, 3] = -0.0
    odd[6, 6148] = 50.0                                       # the largest in the tail
    odd[7, :3] = float("nan")
    for x in (odd, torch.randn(40, 6144, generator=gen), torch.randn(3, 7, generator=gen)):
        with _Pool(kernels, threads):
            assert torch.equal(_c_argmax(kernels, x), x.argmax(-1))
    x = torch.randn(2, 3, 100, generator=gen)
    assert torch.equal(native.argmax(x), x.argmax(-1))       # [..., V] -> [...]
    assert torch.equal(native.argmax(x.double()), x.double().argmax(-1))   # not float32: torch's


@pytest.mark.parametrize("threads", [1, 3])
def test_the_c_greedy_head_is_greedy_accept_over_the_output_linears_logits(threads, kernels):
    """half_gemm.c `greedy_head` (a greedy verify's output linear, argmax and acceptance in one
    call) returns what `greedy_accept` returns over the same GEMM's logits: rows that keep none,
    some, all of their drafts or stop at a -1 pad, 1-13 rows, a vocabulary not a whole number of
    panels, a bias, rows split over a pool; a plain step (no drafts) keeps none."""
    from pipeline.model import native
    from pipeline.model.packed import Fp16WeightLinear
    from pipeline.spec_decode.acceptance import greedy_accept
    gen = torch.Generator().manual_seed(5)
    k, v = 96, 6144 + 37
    linear = Fp16WeightLinear(torch.randn(v, k, generator=gen).half().float(), torch.randn(v, generator=gen),
                              kernel="native")
    for n, q in ((1, 1), (1, 4), (5, 3), (13, 6)):
        hidden = torch.randn(n, q, k, generator=gen)
        logits = native.linear(hidden, linear._packed, linear._bias, v, lib=kernels)
        target = logits.argmax(-1)                                          # [n, q]
        drafts = torch.randint(0, v, (n, q - 1), generator=gen)
        for r in range(n):                                                  # keep r % q drafts
            drafts[r, :r % q] = target[r, :r % q]
        if n > 1 and q > 2:
            drafts[1, :] = target[1, :-1]
            drafts[1, 1] = -1                                               # a pad stops the row
        with _Pool(kernels, threads):
            got = native.greedy_head(linear, hidden, drafts, lib=kernels)
        want = greedy_accept(drafts, logits)
        assert got is not None and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert got[0].tolist() == [(1 if n > 1 and q > 2 and r == 1 else r % q) for r in range(n)]


def test_greedy_steps_take_the_c_head_with_the_same_tokens(tmp_path, monkeypatch):
    """The engine's greedy uniform steps verify through native.greedy_head (one call a step,
    plain steps included) and emit what the step emits with torch's logits and acceptance."""
    from pipeline.engine import SamplingParams
    from pipeline.model import native
    engine = _native_demo_like_engine(tmp_path, monkeypatch, heads=1)
    real, calls = native.greedy_head, []

    def counted(*args, **kw):
        got = real(*args, **kw)
        calls.append(got is not None)
        return got
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8], [11, 4, 6, 1, 2, 9, 10]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = {}
    for name, fn in (("c", counted), ("torch", lambda *a, **k: None)):
        monkeypatch.setattr(native, "greedy_head", fn)
        for g in (0, 2):
            calls.clear()
            outs[name, g] = [o.token_ids for o in engine.generate(prompts, params, gamma=g, draft="mtp")]
            if name == "c":                                       # one C call a step, each taken
                assert len(calls) == len(engine.last_stats.steps) > 0 and all(calls)
    assert outs["c", 0] == outs["torch", 0] and outs["c", 2] == outs["torch", 2]


def _forked_gemm(lib_path, queue):
    from pipeline.model import native
    torch.set_num_threads(1)            # torch's own OpenMP team does not survive a fork (its matmuls hang)
    lib = native.load(lib_path)
    w = torch.arange(64 * 256, dtype=torch.float32).reshape(256, 64) / 4096
    with _Pool(lib, 2):
        y = native.linear(torch.ones(2, 64), native.pack(w), None, 256, lib)
    queue.put(float(y.sum()))


def test_a_forked_child_runs_the_c_kernels(kernels):
    """A child forked after the pool started (a data loader, a Ray worker made by fork) has none
    of its workers: its calls start their own and finish, with the parent's result."""
    import multiprocessing
    from pipeline.model import native
    w = torch.arange(64 * 256, dtype=torch.float32).reshape(256, 64) / 4096
    with _Pool(kernels, 2):
        want = float(native.linear(torch.ones(2, 64), native.pack(w), None, 256, kernels).sum())
    if kernels is not native.library():
        pytest.skip("the child loads the default build")
    path = native.build()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_forked_gemm, args=(path, queue))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == 0 and queue.get(timeout=5) == want


def test_cpu_linear_takes_the_fp16_gemm_only_for_weights_float16_holds(monkeypatch):
    from pipeline.model import packed
    from pipeline.model.packed import Fp16WeightLinear, cpu_linear, fp16_exact, fp16_gemm_works
    monkeypatch.setattr(packed, "fp16_gemm_rows", lambda *shape: 4)
    w = torch.randn(16, 8).half().float()
    assert fp16_exact(w)
    assert isinstance(cpu_linear(w), Fp16WeightLinear) == fp16_gemm_works()
    w[3, 2] = 1 + 2 ** -12                      # float16 keeps 10 bits after the point: not held
    assert not fp16_exact(w)
    assert type(cpu_linear(w)) is PackedLinear
    x = torch.randn(4, 8)
    torch.testing.assert_close(cpu_linear(w)(x), x @ w.t())


def test_cpu_linear_keeps_float32_where_this_machine_runs_it_faster(monkeypatch):
    """The kernel is chosen by timing both on the running machine (per weight shape, torch's
    and the C kernels' thread counts): where FBGEMM wins at no row count, a weight float16
    holds stays PackedLinear."""
    from pipeline.model import native, packed
    seen = []
    monkeypatch.setattr(packed, "fp16_gemm_rows", lambda *key: seen.append(key) or 0)
    w = torch.randn(16, 8).half().float()
    assert type(packed.cpu_linear(w)) is PackedLinear
    if packed.fp16_gemm_works():
        assert seen == [(16, 8, torch.get_num_threads(), packed.fp16_kernel(), native.pool_threads())]


def test_a_float16_gemm_that_wins_at_every_row_count_timed_takes_any(monkeypatch):
    """Where the float16-weight GEMM wins up to the largest row count timed (ROWS[-1]), a prefill's
    or a wide verify's rows take it too (max_rows None); a crossover below that caps it."""
    from pipeline.model import packed
    from pipeline.model.packed import ROWS, Fp16WeightLinear
    if not packed.fp16_gemm_works():
        pytest.skip("this torch build has no float16-weight GEMM")
    w = torch.randn(16, 8).half().float()
    for timed, cap in ((ROWS[-1], None), (ROWS[-2], ROWS[-2])):
        monkeypatch.setattr(packed, "fp16_gemm_rows", lambda *key: timed)
        layer = packed.cpu_linear(w)
        assert isinstance(layer, Fp16WeightLinear) and layer.max_rows == cap


def test_fp16_weight_linear_hands_inputs_past_max_rows_to_float32(monkeypatch):
    """Up to max_rows input rows (all leading dims together) FBGEMM's GEMM, beyond them the
    float32 one: where the arithmetic, not the weight's bytes, bounds a linear."""
    from pipeline.model.packed import Fp16WeightLinear, fp16_gemm_works
    if not fp16_gemm_works():
        pytest.skip("this torch build has no FBGEMM float16-weight GEMM")
    calls = []
    float32_forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: calls.append(x.shape) or float32_forward(self, x))
    w = torch.randn(16, 8).half().float()
    layer = Fp16WeightLinear(w, torch.randn(16), max_rows=4)
    for x in [torch.randn(4, 8), torch.randn(2, 2, 8), torch.randn(5, 8), torch.randn(1, 6, 8)]:
        torch.testing.assert_close(layer(x), x @ w.t() + layer.bias, rtol=1e-5, atol=1e-5)
    assert calls == [(5, 8), (1, 6, 8)]


def test_fp16_gemm_rows_times_each_shape_once():
    from pipeline.model.native import rows_per_pass
    from pipeline.model.packed import ROWS, fp16_gemm_rows, fp16_gemm_works
    if not fp16_gemm_works():
        pytest.skip("this machine has no float16-weight GEMM")
    fp16_gemm_rows.cache_clear()
    assert fp16_gemm_rows(24, 16, 1) in (0, rows_per_pass(), *ROWS)
    fp16_gemm_rows(24, 16, 1)
    fp16_gemm_rows(32, 16, 1)
    info = fp16_gemm_rows.cache_info()
    assert (info.hits, info.misses) == (1, 2)


def test_fp16_gemm_crossover_needs_a_clear_win_at_one_row_then_parity():
    """FBGEMM is taken for a weight only where it wins clearly at one row, and then up to the
    last row count where it is no slower: a 10% margin past one row put the demo's q|k|v
    crossover at 4 rows in one process and 8 in the next (a 6-token verify changed kernel)."""
    from pipeline.model.packed import crossover
    assert crossover({1: (10.0, 7.0), 2: (11.0, 8.0), 4: (12.0, 12.5)}) == 2
    assert crossover({1: (10.0, 8.0), 2: (10.0, 9.8), 4: (10.0, 9.9), 8: (10.0, 10.1)}) == 4
    assert crossover({1: (10.0, 9.5), 2: (11.0, 5.0)}) == 0          # at one row only 5% ahead
    assert crossover({1: (10.0, 7.0), 2: (11.0, 8.0)}) == 2          # won every row measured


def test_fp16_gemm_crossover_above_a_floor():
    """The native kernel is taken up to its rows per pass untimed (`floor`); above, parity."""
    from pipeline.model.packed import crossover
    assert crossover({8: (10.0, 10.5)}, floor=6) == 6
    assert crossover({8: (10.0, 9.9), 16: (10.0, 10.5)}, floor=6) == 8
    assert crossover({}, floor=6) == 6


def test_rope_with_folded_sin_is_transformers_rope_bit_for_bit():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from pipeline.model.layers import apply_rope, fold_sin
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 5, 16, generator=gen), torch.randn(3, 2, 5, 16, generator=gen)
    angles = torch.randn(3, 5, 8, generator=gen) * 10
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(apply_rope(q, cos, fold_sin(sin)), want_q)
    assert torch.equal(apply_rope(k, cos, fold_sin(sin)), want_k)


@pytest.mark.parametrize("window", [None, 3])
def test_additive_mask_gives_the_bool_masks_attention(window):
    """Batch.mask(window, dtype): the 0 / -inf form attention makes of the bool mask, built once
    per forward; the same outputs, and cached per (window, dtype)."""
    from pipeline.model.cache import Batch
    gen = torch.Generator().manual_seed(1)
    positions = torch.tensor([[4, 5, 6], [2, 3, 4]])
    valid = torch.rand(2, 7, generator=gen) > 0.3
    batch = Batch.make(positions, kv_len=7, key_valid=valid)
    allowed, additive = batch.mask(window), batch.mask(window, torch.float32)
    assert additive.dtype == torch.float32 and torch.equal(additive == 0, allowed)
    assert torch.isinf(additive[~allowed]).all() and batch.mask(window, torch.float32) is additive
    q, k, v = (torch.randn(2, 2, s, 8, generator=gen) for s in (3, 7, 7))
    F = torch.nn.functional
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=additive),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))


def _reference_attention(qkv, cos, sin, positions, rows, k_cache, v_cache, valid, window, hq):
    """The torch path (apply_rope, KVCache.write, Batch.mask, SDPA) in float64, writing the cache."""
    from pipeline.model.cache import Batch
    from pipeline.model.layers import apply_rope
    n, q, _ = qkv.shape
    _, hk, _, d = k_cache.shape
    x = qkv.view(n, q, hq + 2 * hk, d)
    qs = apply_rope(x[:, :, :hq].transpose(1, 2), cos, sin)
    ks = apply_rope(x[:, :, hq:hq + hk].transpose(1, 2), cos, sin)
    r = torch.arange(n) if rows is None else rows
    k_cache[r[:, None], :, positions] = ks.transpose(1, 2)
    v_cache[r[:, None], :, positions] = x[:, :, hq + hk:]
    kv_len = int(positions.max()) + 1
    batch = Batch.make(positions, rows=rows, kv_len=kv_len, key_valid=None if valid is None else valid[:, :kv_len])
    out = F.scaled_dot_product_attention(qs.double(), k_cache[r, :, :kv_len].double(), v_cache[r, :, :kv_len].double(),
                                         attn_mask=batch.mask(window), enable_gqa=True)
    return out.transpose(1, 2).reshape(n, q, hq * d)


@pytest.mark.parametrize("n,q,hq,hk,d,window,masked,rows", [
    (1, 1, 8, 4, 32, None, False, False), (2, 3, 8, 4, 32, None, True, True), (3, 6, 4, 4, 64, 5, True, False),
    (1, 9, 16, 2, 128, None, False, True), (4, 2, 6, 3, 40, 3, False, False), (2, 17, 2, 1, 16, 7, True, True),
    (2, 5, 4, 2, 20, None, True, True)])
def test_native_attention_is_the_torch_path_with_its_cache_writes(n, q, hq, hk, d, window, masked, rows, kernels):
    """attend (half_gemm.c) against RoPE, the cache write, the mask and SDPA in float64: grouped
    heads, head widths that fill no vector or several, more than 16 keys, cache rows out of
    order, holes in the keys (the MTP caches'), sliding windows; keys and values land in the
    cache with the torch path's bits."""
    from pipeline.model import native
    from pipeline.model.layers import fold_sin
    _kernel_or_skip("native")
    gen = torch.Generator().manual_seed(n * 100 + q)
    k_cache, v_cache = torch.randn(6, hk, 64, d, generator=gen), torch.randn(6, hk, 64, d, generator=gen)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(n, q, (hq + 2 * hk) * d, generator=gen)
    cache_rows = torch.randperm(6, generator=gen)[:n] if rows else None
    positions = torch.randint(0, 40, (n, 1), generator=gen) + torch.arange(q)
    angles = torch.randn(n, q, d, generator=gen) * 5
    cos, sin = angles.cos(), fold_sin(angles.sin())
    valid = torch.rand(n, 60, generator=gen) > 0.3 if masked else None
    out = native.attend(qkv, cos, sin, positions, cache_rows, k_cache, v_cache, valid, window, hq, kernels)
    want = _reference_attention(qkv, cos, sin, positions, cache_rows, k_ref, v_ref, valid, window, hq)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_attention_takes_the_c_kernel_for_a_steps_few_tokens_only():
    """A cached CPU attention of up to NATIVE_ATTN_TOKENS query tokens runs the C kernel and
    matches the torch path; a prefill from position 0, a wider forward and an input that needs
    a gradient keep torch's ops. The two sum in their own orders, and at 512 queries of this
    layer's large scores float32 itself is off by ~7e-4 (outputs ~150): each is measured against
    the layer in float64, and the C kernel must come as close to it as torch's float32 does."""
    from pipeline.model import native
    from pipeline.model.cache import Batch, KVCache
    from pipeline.model.config import ArchConfig
    from pipeline.model.layers import NATIVE_ATTN_TOKENS, Attention
    _kernel_or_skip("native")
    cfg = ArchConfig("LlamaForCausalLM", 64, 32, 64, 1, 4, 2, 8, 1e-6, 512, False, False, False, False, False,
                     (None,), 0, ())
    gen = torch.Generator().manual_seed(0)
    attn = Attention(cfg, None)
    for p in attn.parameters():
        p.data.normal_(generator=gen)
    attn.fuse_()
    exact = copy.deepcopy(attn).double()
    calls = []
    lib = native.library()
    attn.native = type("Spy", (), {"attend": lambda self, *a: calls.append(a[1]) or lib.attend(*a)})()

    for rows, q, start in ((1, 1, 5), (2, 3, 7), (1, NATIVE_ATTN_TOKENS, 0), (1, NATIVE_ATTN_TOKENS + 1, 0)):
        positions = torch.arange(q)[None].expand(rows, q) + start
        angles = positions[..., None].float() * torch.linspace(0.1, 1.0, 8)
        caches = [KVCache(1, rows, start + q, 2, 8, dt, "cpu") for dt in (torch.float32,) * 2 + (torch.float64,)]
        x = torch.randn(rows, q, 32, generator=gen)
        outs = []
        for cache, on in zip(caches, (True, False, False)):
            dt = cache.k.dtype
            batch = Batch.make(positions, kv_len=start + q)
            batch.cos, batch.sin = angles.cos().to(dt), angles.sin().to(dt)
            layer = attn if dt == torch.float32 else exact
            outs.append((attn.forward(x, batch, cache, 0) if on else _without_native(layer, x.to(dt), batch, cache)).double())
        err_c, err_torch = ((o - outs[2]).abs().max().item() for o in outs[:2])
        assert err_c <= 2 * err_torch + 1e-6, (rows, q, err_c, err_torch)
        torch.testing.assert_close(caches[0].k, caches[1].k, rtol=0, atol=0)
    assert calls == [1, 3, NATIVE_ATTN_TOKENS]           # q of each call that took the C kernel
    batch = Batch.from_start(1, 4, "cpu")                  # a prefill: plain causal SDPA
    batch.cos, batch.sin = torch.ones(1, 4, 8), torch.zeros(1, 4, 8)
    attn.forward(torch.randn(1, 4, 32), batch, KVCache(1, 1, 8, 2, 8, torch.float32, "cpu"), 0)
    x = torch.randn(1, 1, 32, requires_grad=True)
    batch = Batch.make(torch.tensor([[3]]))
    batch.cos, batch.sin = torch.ones(1, 1, 8), torch.zeros(1, 1, 8)
    attn.forward(x, batch, KVCache(1, 1, 8, 2, 8, torch.float32, "cpu"), 0).sum().backward()
    assert x.grad is not None and len(calls) == 3


def _without_native(attn, x, batch, cache):
    spy, attn.native = attn.native, None
    try:
        return attn.forward(x, batch, cache, 0)
    finally:
        attn.native = spy


def _c_stack_target(tmp_path, monkeypatch, arch="llama", config=None):
    """A tiny checkpoint's target with every layer on the C stack (the native GEMM at any rows),
    its config.json updated by `config`; returns (target, its config, the shape of x at each
    native.decoder_stack or native.target_forward call made from then on)."""
    import json
    from pipeline.demo.build import store_weights
    from pipeline.model import native, packed
    from pipeline.model.tiny import make_tiny_checkpoint
    _kernel_or_skip("native")
    monkeypatch.setattr(packed, "fp16_kernel", lambda: "native")
    monkeypatch.setattr(packed, "fp16_gemm_rows", lambda *shape: packed.ROWS[-1])   # any rows: C layers
    path = make_tiny_checkpoint(tmp_path / "m", arch=arch, num_mtp_layers=1, with_tokenizer=False)
    if config:
        cfg_file = path / "config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **config}))
    store_weights(path, "bfloat16", log=lambda _: None)
    engine = Engine.from_pretrained(str(path), device="cpu", max_batch_size=4)
    assert engine.target.native_stack() is not None
    calls = []
    real, fused = native.decoder_stack, native.target_forward
    monkeypatch.setattr(native, "decoder_stack", lambda *a: calls.append(tuple(a[1].shape)) or real(*a))
    monkeypatch.setattr(native, "target_forward",            # the stack inside a step's fused forward
                        lambda *a: calls.append((*a[1].shape, a[2].shape[1])) or fused(*a))
    return engine.target, engine.config, calls


def test_the_target_runs_its_layers_as_one_c_call_with_the_same_bits(tmp_path, monkeypatch):
    """Where every decoder layer is one C call, a step's forward runs them all as one
    (native.decoder_stack): the same outputs and cache writes, bit for bit, as a call per
    layer (rows in order or not, several tokens a row); with one layer's C path off, the
    target goes back to a call per layer. (The fused step, embedding to norm in one call, is
    off here: test_a_steps_whole_forward_in_one_c_call_gives_the_same_bits.)"""
    from pipeline.model.cache import Batch, KVCache
    target, cfg, calls = _c_stack_target(tmp_path, monkeypatch)
    target.fused_step = False
    gen = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for n, q, rows in ((1, 1, None), (3, 4, [2, 0, 3])):
            tokens = torch.randint(0, cfg.vocab_size, (n, q), generator=gen)
            positions = torch.randint(3, 20, (n, 1), generator=gen) + torch.arange(q)
            fresh = KVCache(cfg.num_layers, 4, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
            fresh.k.normal_(generator=gen), fresh.v.normal_(generator=gen)
            outs = []
            for stack in (True, False):
                cache = KVCache(cfg.num_layers, 4, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
                cache.k.copy_(fresh.k), cache.v.copy_(fresh.v)
                if not stack:
                    target.native_stack = lambda: None                  # a C call per layer
                batch = Batch.make(positions, rows=None if rows is None else torch.tensor(rows), kv_len=32)
                outs.append((target(tokens, batch, cache), cache.k, cache.v))
                target.__dict__.pop("native_stack", None)
            assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert calls == [(1, 1, cfg.hidden_size), (3, 4, cfg.hidden_size)]
    target.model.layers[1].native_layer = None
    assert target.native_stack() is None


@pytest.mark.parametrize("arch,window", [("llama", None), ("mistral", 5)])
def test_a_steps_whole_forward_in_one_c_call_gives_the_same_bits(tmp_path, monkeypatch, arch, window):
    """A cached step's forward as one C call (native.target_forward: embedding rows, rotary rows,
    the stack, the final norm) gives the outputs and cache writes of the separate calls, bit for
    bit: rows in order or not, several tokens a row, a key mask, a sliding window, and a step
    past NATIVE_NORM_ROWS tokens whose norm stays torch's. A prefill from position 0 and a
    batch with its rotary rows attached are not taken."""
    from pipeline.model import native
    from pipeline.model.cache import Batch, KVCache
    from pipeline.model.layers import NATIVE_NORM_ROWS
    target, cfg, _ = _c_stack_target(tmp_path, monkeypatch, arch, {"sliding_window": window} if window else None)
    fused = []
    real = native.target_forward
    monkeypatch.setattr(native, "target_forward", lambda *a: fused.append(tuple(a[1].shape)) or real(*a))
    gen = torch.Generator().manual_seed(7)
    big = NATIVE_NORM_ROWS // 4 + 1                     # 4 rows x this: past the C norm's rows
    shapes = ((1, 1, None, False), (3, 4, [2, 0, 3], False), (2, 3, [1, 3], True), (4, big, None, False))
    with torch.inference_mode():
        for n, q, rows, masked in shapes:
            tokens = torch.randint(0, cfg.vocab_size, (n, q), generator=gen)
            positions = torch.randint(3, 20, (n, 1), generator=gen) + torch.arange(q)
            width = 20 + q + 1
            valid = torch.rand(n, width, generator=gen) < 0.7 if masked else None
            fresh = KVCache(cfg.num_layers, 4, 128, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
            fresh.k.normal_(generator=gen), fresh.v.normal_(generator=gen)
            outs = []
            for on in (True, False):
                target.fused_step = on
                cache = KVCache(cfg.num_layers, 4, 128, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
                cache.k.copy_(fresh.k), cache.v.copy_(fresh.v)
                batch = Batch.make(positions, rows=None if rows is None else torch.tensor(rows), kv_len=width,
                                   key_valid=valid)
                outs.append((target(tokens, batch, cache), cache.k, cache.v))
            assert all(torch.equal(a, b) for a, b in zip(*outs))
        assert fused == [(n, q) for n, q, _, _ in shapes]
        target.fused_step = True
        cache = KVCache(cfg.num_layers, 2, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        target(torch.zeros(2, 5, dtype=torch.long), Batch.from_start(2, 5, "cpu"), cache)          # a prefill
        batch = Batch.make(torch.tensor([[5], [6]]), kv_len=7)
        target.attach_rope(batch)
        target(torch.zeros(2, 1, dtype=torch.long), batch, cache)                                   # rope attached
        assert len(fused) == len(shapes)


@pytest.mark.parametrize("arch,window", [("llama", None), ("mistral", 5)])
def test_a_prefill_runs_through_the_c_layers_in_pieces_as_the_modules_do(tmp_path, monkeypatch, arch, window):
    """A prefill from position 0 takes the C stack in pieces (TargetModel._prefill_pieces): a
    few positions of a few rows a call, each row's pieces in order, a piece attending to what
    its earlier ones cached. Its hidden states and cache writes are those of the layers' modules
    up to float32 rounding, with padded rows, rows out of slot order and sliding windows."""
    from pipeline.model import target as target_module
    from pipeline.model.cache import Batch, KVCache
    monkeypatch.setattr(target_module, "PREFILL_PIECE", 4)
    monkeypatch.setattr(target_module, "PREFILL_TOKENS", 8)       # 4 positions of 2 rows a call
    target, cfg, calls = _c_stack_target(tmp_path, monkeypatch, arch, {"sliding_window": window} if window else {})
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (3, 10), generator=gen)
    tokens[1, 6:] = 0                                               # a shorter prompt, padded
    with torch.inference_mode():
        outs = []
        for native_prefill in (True, False):
            if not native_prefill:
                monkeypatch.setattr(target_module.TargetModel, "_native_prefill", staticmethod(lambda *a: False))
            cache = KVCache(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
            hidden = target(tokens, Batch.from_start(3, 10, "cpu", rows=torch.tensor([3, 0, 2])), cache)
            outs.append((hidden, cache.k[:, [3, 0, 2], :, :10], cache.v[:, [3, 0, 2], :, :10]))
    assert [c[:2] for c in calls] == [(2, 4), (2, 4), (2, 2), (1, 4), (1, 4), (1, 2)]     # two rows, then one, in pieces
    for c, t in zip(*outs):
        assert torch.allclose(c, t, rtol=1e-4, atol=1e-5), (c - t).abs().max()


@pytest.mark.parametrize("qkv_bias,window", [(False, None), (True, 4)])
def test_native_decoder_layer_is_the_modules_forward(qkv_bias, window, monkeypatch):
    """A packed, fused DecoderLayer as one C call (native.decoder_layer) against the same layer
    through its modules with torch's attention: a step's shapes (1-3 rows of 1-6
    tokens, cache rows out of order, key holes), biases, a sliding window; the same cache
    writes (to rounding: past its crossover a module's linear is MKL's). Its linears' crossovers
    set no cap on the C layer (a crossover of 4 rows: 18 tokens in one call); past a cap set on
    it the layer takes the modules."""
    from pipeline.model.cache import Batch, KVCache
    from pipeline.model.config import ArchConfig
    from pipeline.model import packed
    from pipeline.model.layers import DecoderLayer
    from pipeline.model.packed import pack_linears_
    _kernel_or_skip("native")
    monkeypatch.setattr(packed, "fp16_kernel", lambda: "native")       # whatever torch's thread count
    cfg = ArchConfig("LlamaForCausalLM", 64, 48, 80, 1, 6, 2, 8, 1e-6, 512, False, qkv_bias, False, False, False,
                     (window,), 0, ())
    gen = torch.Generator().manual_seed(3)
    layer = DecoderLayer(cfg, window)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.3).half().float())
    layer.fuse_()
    monkeypatch.setattr(packed, "fp16_gemm_rows", lambda *key: 4)      # a crossover at 4 rows
    pack_linears_(layer)
    nl = layer.native_layer
    assert nl is not None and nl.max_tokens is None and layer.mlp.down_proj.max_rows == 4
    calls = []
    real = nl.lib

    class Spy:
        def decoder_layer(self, *a):
            calls.append(a[1] * a[2])
            return real.decoder_layer(*a)
    nl.lib = Spy()
    for n, q, rows, holes in ((1, 1, None, False), (2, 3, [4, 1], True), (3, 6, [0, 2, 5], False)):
        positions = torch.randint(0, 30, (n, 1), generator=gen) + torch.arange(q)
        angles = positions[..., None].float() * torch.linspace(0.05, 1.0, 8)
        x = torch.randn(n, q, 48, generator=gen)
        valid = torch.rand(n, 40, generator=gen) > 0.3 if holes else None
        outs, caches = [], []
        for on in (True, False):
            cache = KVCache(1, 6, 40, 2, 8, torch.float32, "cpu")
            batch = Batch.make(positions, rows=None if rows is None else torch.tensor(rows), kv_len=40,
                               key_valid=valid)
            batch.cos, batch.sin = angles.cos(), angles.sin()
            saved = [(layer.self_attn, layer.self_attn.native)]       # the reference: torch's attention
            if not on:
                layer.native_layer = None
                for m, _ in saved:
                    m.native = None
            outs.append(layer.block(x, batch, cache, 0))
            caches.append(cache)
            layer.native_layer = nl
            for m, lib in saved:
                m.native = lib
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[0].k, caches[1].k, rtol=1e-5, atol=1e-6)   # the modules' linears
        torch.testing.assert_close(caches[0].v, caches[1].v, rtol=1e-5, atol=1e-6)   # may be MKL's past 8 rows
    assert calls == [1, 6, 18]
    nl.max_tokens = 6                                       # a cap of 6 tokens: 18 take the modules
    batch = Batch.make(torch.arange(6).expand(3, 6) + 2, kv_len=40)
    batch.cos, batch.sin = torch.ones(3, 6, 8), torch.zeros(3, 6, 8)
    layer.block(torch.randn(3, 6, 48), batch, KVCache(1, 3, 40, 2, 8, torch.float32, "cpu"), 0)
    assert calls == [1, 6, 18]


def _native_demo_like_engine(tmp_path, monkeypatch, heads=2):
    """A tiny checkpoint whose weights float16 holds, loaded with every CPU linear on the native
    float16 GEMM (whatever this machine's thread count and crossover), heads over a draft
    vocabulary."""
    from pipeline.demo.build import store_weights
    from pipeline.model import packed
    from pipeline.model.tiny import make_tiny_checkpoint
    _kernel_or_skip("native")
    monkeypatch.setattr(packed, "fp16_kernel", lambda: "native")
    monkeypatch.setattr(packed, "fp16_gemm_rows", lambda *shape: 16)
    path = make_tiny_checkpoint(tmp_path / "m", arch="llama", num_mtp_layers=heads, draftable=0.1,
                                with_tokenizer=False)
    store_weights(path, "bfloat16", log=lambda _: None)
    engine = Engine.from_pretrained(str(path), device="cpu", max_batch_size=3)
    for head in engine.heads:
        head.set_draft_vocab(torch.arange(0, 128, 2))
    return engine


def test_native_mtp_head_forward_is_the_modules_forward(tmp_path, monkeypatch):
    """MTPHead.forward as one C call (embedding, the two norms, eh_proj, the layer) against the
    same head through its modules, at a fill's and a draft depth's shapes, with key holes."""
    from pipeline.model.cache import Batch, KVCache
    engine = _native_demo_like_engine(tmp_path, monkeypatch)
    head = engine.heads[0]
    assert head.native_head is not None
    attn = head.self_attn
    gen = torch.Generator().manual_seed(0)
    for n, q in ((1, 1), (3, 4)):
        prev = torch.randn(n, q, engine.config.hidden_size, generator=gen)
        ids = torch.randint(0, 128, (n, q), generator=gen)
        positions = torch.randint(0, 20, (n, 1), generator=gen) + torch.arange(q)
        valid = torch.rand(n, 32, generator=gen) > 0.3
        outs, caches = [], []
        for on in (True, False):
            cache = KVCache(1, 3, 32, attn.num_kv_heads, attn.head_dim, torch.float32, "cpu")
            batch = Batch.make(positions, kv_len=32, key_valid=valid)
            saved = head.native_head, head.native_layer, attn.native
            if not on:
                head.native_head = head.native_layer = attn.native = None
            with torch.inference_mode():
                outs.append(head(prev, ids, batch, cache, 0))
            head.native_head, head.native_layer, attn.native = saved
            caches.append(cache)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(caches[0].k, caches[1].k, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads", [1, 2])
def test_greedy_drafts_in_c_are_the_python_loops(tmp_path, monkeypatch, heads):
    """The MTP drafter's greedy C path (native.mtp_greedy: each head's depths in one call) drafts
    what its Python loop drafts, over two steps (fills, carries and masks as a generate call
    leaves them), at gamma 1-5 with one head and with two (depth 1 from the first head, the
    rest from the second), for 1 and 3 rows."""
    from pipeline.engine.drafter import PendingFill
    from pipeline.engine.drafters.mtp import MTPSource
    from pipeline.model import native
    from pipeline.spec_decode.sampling import GREEDY_PICK, argmax_last
    engine = _native_demo_like_engine(tmp_path, monkeypatch, heads)
    calls = []
    real = native.mtp_greedy
    monkeypatch.setattr(native, "mtp_greedy", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    python_pick = lambda logits, _: (argmax_last(logits), None)      # noqa: E731  (not marked greedy)
    hidden = engine.config.hidden_size
    for n in (1, 3):
        for gamma in range(1, 6):
            gen = torch.Generator().manual_seed(10 * n + gamma)
            drafters = [MTPSource.for_engine(engine, 3, 64).drafter for _ in range(2)]
            start = torch.randint(5, 20, (n,), generator=gen)
            for step in range(2):
                w = 3
                fill = dict(hidden=torch.randn(n, w, hidden, generator=gen), next_ids=torch.randint(0, 128, (n, w), generator=gen),
                            count=torch.randint(1, w + 1, (n,), generator=gen))
                got = []
                for d, pick in zip(drafters, (GREEDY_PICK, python_pick)):
                    d.add_pending(PendingFill(torch.arange(n), start.clone(), fill["hidden"], fill["next_ids"],
                                              fill["count"], slots=list(range(n)), counts=fill["count"].tolist()))
                    with torch.inference_mode():
                        drafts, probs = d.propose(n, start + fill["count"], gamma, pick)
                    got.append(drafts)
                assert torch.equal(got[0], got[1]), (n, gamma, step)
                start = start + fill["count"]
    runs = sum(1 if heads == 1 or gamma == 1 else 2 for gamma in range(1, 6))     # a call per head's run of depths
    assert len(calls) == 2 * 2 * runs                                             # (rows 1 and 3, two steps)


@pytest.mark.parametrize("heads,vocab", [(1, "draft"), (2, "draft"), (2, "full")])
def test_coupled_drafts_in_c_are_the_python_loops(tmp_path, monkeypatch, heads, vocab):
    """Coupled sampling's drafts picked inside the heads' C loop (native.mtp_greedy's `coupled`:
    softmax at the temperature over the C noise, argmax of p / E) are the drafts the Python
    loop's pick makes (filtered_probs, CoupledSampler.draft over the full vocabulary), over two
    steps, gamma 1-5, 1 and 3 rows with their own keys, over a draft vocabulary and without;
    and the C path ran, one call per head's run of depths. Random tiny weights leave no near-ties
    at float32 precision, so the two pick alike token for token."""
    from pipeline.engine.coupled import CoupledDraftPick, CoupledSampler
    from pipeline.engine.drafter import PendingFill
    from pipeline.engine.drafters.mtp import MTPSource
    from pipeline.model import native
    from pipeline.spec_decode.sampling import filtered_probs
    engine = _native_demo_like_engine(tmp_path, monkeypatch, heads)
    if vocab == "full":
        for head in engine.heads:
            head.set_draft_vocab(None)
    calls = []
    real = native.mtp_greedy
    bind = inspect.signature(real).bind
    monkeypatch.setattr(native, "mtp_greedy", lambda *a, **k: calls.append(bind(*a, **k).arguments.get("coupled")
                                                                            is not None) or real(*a, **k))
    hidden, temperature, seed = engine.config.hidden_size, 0.9, 5
    picked = []
    for n in (1, 3):
        keys = torch.tensor([7, 1000003, 42])[:n]
        for gamma in range(1, 6):
            gen = torch.Generator().manual_seed(10 * n + gamma)
            drafters = [MTPSource.for_engine(engine, 3, 64, coupled=True).drafter for _ in range(2)]
            start = torch.randint(5, 20, (n,), generator=gen)
            for step in range(2):
                w = 3
                fill = dict(hidden=torch.randn(n, w, hidden, generator=gen) * 3,
                            next_ids=torch.randint(0, 128, (n, w), generator=gen),
                            count=torch.randint(1, w + 1, (n,), generator=gen))
                lengths = start + fill["count"]
                sampler = CoupledSampler(seed, noise=native.exponential_noise)
                python_pick = lambda lg, d: (sampler.draft(filtered_probs(lg, temperature), keys, lengths + d),   # noqa: E731
                                             None)
                c_pick = CoupledDraftPick(python_pick, temperature, seed, keys)
                got = []
                for d, pick in zip(drafters, (c_pick, python_pick)):
                    d.add_pending(PendingFill(torch.arange(n), start.clone(), fill["hidden"], fill["next_ids"],
                                              fill["count"], slots=list(range(n)), counts=fill["count"].tolist()))
                    with torch.inference_mode():
                        drafts, probs = d.propose(n, lengths, gamma, pick)
                    assert probs is None
                    got.append(drafts)
                assert torch.equal(got[0], got[1]), (n, gamma, step, got)
                picked.append(got[0])
                start = lengths
    runs = sum(1 if heads == 1 or gamma == 1 else 2 for gamma in range(1, 6))
    assert calls == [True] * (2 * 2 * runs)                     # every C call picked coupled; Python's took none
    tokens = torch.cat([p.flatten() for p in picked])
    assert tokens.unique().numel() > 20                         # sampled picks, not one argmax token
    if vocab == "draft":                                        # the draft vocabulary: even ids only
        assert (tokens % 2 == 0).all()


def test_coupled_text_with_c_drafts_is_gamma_zeros(tmp_path, monkeypatch):
    """A generate call's coupled drafts come from the heads' C loop (unfiltered sampling) and the
    text is gamma 0's at every gamma; with top-k on, drafts are picked in torch (its kept-token
    noise) and the text is again gamma 0's."""
    from pipeline.engine import SamplingParams
    from pipeline.model import native
    engine = _native_demo_like_engine(tmp_path, monkeypatch, heads=2)
    calls = []
    real = native.mtp_greedy
    bind = inspect.signature(real).bind
    monkeypatch.setattr(native, "mtp_greedy", lambda *a, **k: calls.append(bind(*a, **k).arguments.get("coupled")
                                                                            is not None) or real(*a, **k))
    prompts = [[int(t) for t in torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (4, 9, 2)]
    for extra in ({}, {"top_k": 20}):
        params = SamplingParams(max_new_tokens=20, seed=11, temperature=0.8, verify="coupled", ignore_eos=True, **extra)
        ref = [o.token_ids for o in engine.generate(prompts, params, gamma=0)]
        for gamma in (1, 3, 5):
            calls.clear()
            assert [o.token_ids for o in engine.generate(prompts, params, gamma=gamma)] == ref, (extra, gamma)
            assert calls and all(calls) if not extra else not calls, (extra, gamma, calls)
            assert engine.stats.acceptance_by_depth()[0] > 0


def test_a_heads_step_fill_in_c_is_the_torch_paths(tmp_path, monkeypatch):
    """One head's fill of a step's accepted tokens as one C call (native.mtp_fill) leaves what
    the torch path leaves: the head's key mask (padding entries unmarked), its KV cache, its
    carry and the depth-1 state it returns, for 1 and 3 rows with padded entries, over two steps
    and a backlog fill of several tokens; and drafts the same from there."""
    from pipeline.engine.drafter import PendingFill
    from pipeline.engine.drafters.mtp import MTPSource
    from pipeline.model import native
    from pipeline.spec_decode.sampling import GREEDY_PICK
    engine = _native_demo_like_engine(tmp_path, monkeypatch, heads=1)
    calls = []
    real = native.mtp_fill
    monkeypatch.setattr(native, "mtp_fill", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    hidden = engine.config.hidden_size
    for n in (1, 3):
        gen = torch.Generator().manual_seed(n)
        c_path, torch_path = (MTPSource.for_engine(engine, 3, 64).drafter for _ in range(2))
        torch_path.native_fill = False
        firsts = []                                       # each fill's depth-1 state, as propose got it
        for d in (c_path, torch_path):
            d._fill = lambda pending, fill_of=d._fill: firsts.append(fill_of(pending).clone()) or firsts[-1]
        start = torch.randint(5, 20, (n,), generator=gen)
        for w in (3, 1, 5):
            fill = dict(hidden=torch.randn(n, w, hidden, generator=gen), next_ids=torch.randint(0, 128, (n, w), generator=gen),
                        count=torch.randint(1, w + 1, (n,), generator=gen))
            firsts.clear()
            drafts = []
            for d in (c_path, torch_path):
                d.add_pending(PendingFill(torch.arange(n), start.clone(), fill["hidden"], fill["next_ids"],
                                          fill["count"], slots=list(range(n)), counts=fill["count"].tolist()))
                with torch.inference_mode():
                    drafts.append(d.propose(n, start + fill["count"], 3, GREEDY_PICK)[0])
            assert len(firsts) == 2
            torch.testing.assert_close(firsts[0], firsts[1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(c_path.carry, torch_path.carry, rtol=1e-5, atol=1e-5)
            assert torch.equal(c_path.valid, torch_path.valid) and torch.equal(c_path.carry_ok, torch_path.carry_ok)
            torch.testing.assert_close(c_path.cache.k, torch_path.cache.k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(c_path.cache.v, torch_path.cache.v, rtol=1e-5, atol=1e-5)
            assert torch.equal(drafts[0], drafts[1]), (n, w)
            start = start + fill["count"]
    assert calls == [1] * 3 + [3] * 3              # the C path's fills, and none of the torch path's


@pytest.mark.parametrize("window", [0, 4])
def test_a_prompts_fill_in_c_is_the_torch_paths(tmp_path, monkeypatch, window):
    """A prompt's fill (whole, from position 0, and cut to a window of 4) runs as one C call where
    its rows are slots 0..r-1 and leaves what the torch path leaves: the head's key mask, KV
    cache, carry, carry_ok (False after a gap) and depth-1 state; the drafts from there match.
    One row (batch 1) and three of different lengths."""
    from pipeline.engine.drafters.mtp import MTPSource
    from pipeline.model import native
    from pipeline.spec_decode.sampling import GREEDY_PICK
    engine = _native_demo_like_engine(tmp_path, monkeypatch, heads=1)
    calls = []
    real = native.mtp_fill
    monkeypatch.setattr(native, "mtp_fill", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    hidden = engine.config.hidden_size
    for lens in ([7], [5, 3, 4]):              # (the C path takes up to 16 tokens here: fp16_gemm_rows)
        n, width = len(lens), max(lens)
        gen = torch.Generator().manual_seed(n)
        c_src, torch_src = (MTPSource.for_engine(engine, 3, 64) for _ in range(2))
        torch_src.drafter.native_fill = False
        firsts = []
        for src in (c_src, torch_src):
            src.prompt_window = window
            d = src.drafter
            d._fill = lambda pending, fill_of=d._fill: firsts.append(fill_of(pending).clone()) or firsts[-1]
        ids = torch.randint(0, 128, (n, width), generator=gen)
        states = torch.randn(n, width, hidden, generator=gen)
        lengths, first = torch.tensor(lens), torch.randint(0, 128, (n,), generator=gen)
        calls.clear()
        drafts = []
        for src in (c_src, torch_src):
            src.drafter.gap[:n] = torch.tensor([i == 1 for i in range(n)])      # row 1 lost tokens after its prompt
            src.after_prefill(torch.arange(n), states, ids, lengths, first)
            with torch.inference_mode():
                drafts.append(src.drafter.propose(n, lengths, 3, GREEDY_PICK)[0])
        c, t = c_src.drafter, torch_src.drafter
        assert calls == [n] and len(firsts) == 2, (lens, calls)
        torch.testing.assert_close(firsts[0], firsts[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c.carry, t.carry, rtol=1e-5, atol=1e-5)
        assert torch.equal(c.valid, t.valid) and torch.equal(c.carry_ok, t.carry_ok)
        assert c.carry_ok[:n].tolist() == [i != 1 for i in range(n)]
        torch.testing.assert_close(c.cache.k, t.cache.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c.cache.v, t.cache.v, rtol=1e-5, atol=1e-5)
        assert torch.equal(drafts[0], drafts[1]), lens


def test_generate_decodes_the_same_tokens_on_one_thread_and_two(tmp_path, monkeypatch):
    """A generate call on two torch threads runs the C kernels on both (native.cpu_threads) and
    decodes what it does on one: greedy under auto and a fixed gamma, and seeded sampling; torch
    has its two threads back after the call."""
    from pipeline.engine.params import SamplingParams
    from pipeline.model import native
    engine = _native_demo_like_engine(tmp_path, monkeypatch)
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8], [11, 4, 6, 1, 9, 12, 2]]
    pools = []
    real = native.decoder_stack
    monkeypatch.setattr(native, "decoder_stack", lambda *a: pools.append(native.pool_threads()) or real(*a))
    threads = torch.get_num_threads()
    try:
        outs = {}
        for t in (1, 2):
            torch.set_num_threads(t)
            outs[t] = [[o.token_ids for o in engine.generate(prompts, params, gamma=g)]
                       for params, g in ((SamplingParams(max_new_tokens=12), "auto"),
                                         (SamplingParams(max_new_tokens=12), 3),
                                         (SamplingParams(max_new_tokens=12, temperature=0.8, seed=3), "auto"))]
            assert torch.get_num_threads() == t
        assert outs[1] == outs[2]
        assert set(pools) == {1, 2}
    finally:
        torch.set_num_threads(threads)


def test_a_c_stack_forward_of_many_tokens_gives_one_threads_bits_on_two(tmp_path, monkeypatch):
    """A forward of 40 tokens through the C stack on two threads (linears, attention and the
    layers' row-wise parts split among them) writes the same hidden states and cache entries as
    on one."""
    from pipeline.model import native
    from pipeline.model.cache import Batch, KVCache
    target, cfg, calls = _c_stack_target(tmp_path, monkeypatch)
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, cfg.vocab_size, (4, 10), generator=gen)
    positions = torch.randint(3, 12, (4, 1), generator=gen) + torch.arange(10)
    fresh = KVCache(cfg.num_layers, 4, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    fresh.k.normal_(generator=gen), fresh.v.normal_(generator=gen)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            cache = KVCache(cfg.num_layers, 4, 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
            cache.k.copy_(fresh.k), cache.v.copy_(fresh.v)
            with torch.inference_mode(), native.cpu_threads():
                assert native.pool_threads() == min(t, native._cpus())
                outs.append((target(tokens, Batch.make(positions, kv_len=32), cache), cache.k, cache.v))
    finally:
        torch.set_num_threads(threads)
    assert calls == [(4, 10, cfg.hidden_size)] * 2
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def _c_noise(lib, seed, keys, positions, vocab, tokens=None):
    """rng.exponential_noise's values from `lib` (native.exponential_noise's call)."""
    from pipeline.spec_decode import rng
    pos = positions.reshape(-1).contiguous()
    k = keys.view(-1, *([1] * (positions.dim() - 1))).expand(positions.shape).reshape(-1).contiguous()
    ids = None if tokens is None else tokens.reshape(pos.numel(), -1).contiguous()
    out = torch.empty(*positions.shape, vocab) if tokens is None else torch.empty(tokens.shape)
    lib.exp_noise(pos.numel(), vocab if ids is None else ids.shape[1], rng.stream_word(seed, rng.NOISE),
                  k.data_ptr(), pos.data_ptr(), None if ids is None else ids.data_ptr(), out.data_ptr())
    return out


@pytest.mark.parametrize("threads", [1, 3])
def test_the_c_noise_is_rngs_within_one_ulp(threads, kernels):
    """half_gemm.c `exp_noise` (coupled sampling's noise on CPU, native.exponential_noise): the
    same SplitMix64 integers as rng.exponential_noise, so every value is within one float32 ulp
    of torch's (only -log differs); a token's value is the same computed over the whole
    vocabulary or alone (`tokens`), on any pool split; seeds past 2^63 and negative ones, odd
    vocabularies, positions [n] and [n, q]."""
    from pipeline.model import native
    from pipeline.spec_decode import rng
    gen = torch.Generator().manual_seed(3)
    keys = torch.randint(0, 1 << 40, (6,), generator=gen)
    pos = torch.randint(0, 5000, (6, 3), generator=gen)
    with _Pool(kernels, threads):
        for seed, vocab in ((0, 6144), (7, 97), ((1 << 63) + 5, 1), (-3, 16384 + 3)):
            want = rng.exponential_noise(seed, keys, pos, vocab)
            got = _c_noise(kernels, seed, keys, pos, vocab)
            ulp = torch.nextafter(want, torch.tensor(float("inf"))) - want
            assert got.shape == want.shape and bool(((got - want).abs() <= ulp).all()) and bool((got > 0).all())
            ids = torch.randint(0, vocab, (6, 3, 5), generator=gen)
            assert torch.equal(_c_noise(kernels, seed, keys, pos, vocab, ids), got.gather(-1, ids))
        flat = _c_noise(kernels, 1, keys, pos[:, 0], 50)
        assert torch.equal(flat, _c_noise(kernels, 1, keys, pos[:, :1], 50)[:, 0])
    with _Pool(kernels, 1):                                # the same bits on one thread
        assert torch.equal(_c_noise(kernels, -3, keys, pos, 16384 + 3), got)
    x = native.exponential_noise(2, keys, pos, 300)          # the engine's entry: the loaded library's
    assert torch.equal(x, _c_noise(native.library(), 2, keys, pos, 300))
    for k, p in ((keys[:1], pos[:1]), (keys[:1], pos[:1, 0])):  # one row's key over its positions (a view of stride 0)
        want = rng.exponential_noise(2, k, p, 300)
        ulp = torch.nextafter(want, torch.tensor(float("inf"))) - want
        assert bool(((native.exponential_noise(2, k, p, 300) - want).abs() <= ulp).all())
    native.C_NOISE = False
    try:
        assert torch.equal(native.exponential_noise(2, keys, pos, 300), rng.exponential_noise(2, keys, pos, 300))
    finally:
        native.C_NOISE = True
