"""Invariant 1: greedy output is identical for every gamma and equal to transformers generate()."""
import pytest

from pipeline.engine import Engine, SamplingParams
from tests.tiny_models import hf_greedy, random_prompts, tiny_checkpoint

LENGTHS = [5, 9, 3, 12, 7, 1, 15]
MAX_NEW = 24


def _eos_that_stops_a_row_early(path, prompts):
    """Pick as EOS a token the reference emits mid-way for some row, so early stops are covered."""
    refs = hf_greedy(path, prompts, MAX_NEW)
    for ref in refs:
        for tok in ref[3:MAX_NEW // 2]:
            if tok > 2:
                return tok
    raise AssertionError("no candidate EOS token")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize("arch,num_heads", [("llama", 1), ("qwen2", 1), ("qwen3", 2), ("mistral", 1)])
def test_greedy_matches_transformers_for_every_gamma(root, arch, num_heads):
    probe = tiny_checkpoint(root, arch=arch, num_mtp_layers=num_heads, draftable=0.1, with_tokenizer=False)
    prompts = random_prompts(LENGTHS, 128, seed=1)
    eos = _eos_that_stops_a_row_early(probe, prompts)
    path = tiny_checkpoint(root, arch=arch, num_mtp_layers=num_heads, draftable=0.1,
                           with_tokenizer=False, eos_token_id=eos)
    refs = hf_greedy(path, prompts, MAX_NEW)
    assert any(len(r) < MAX_NEW and r[-1] == eos for r in refs), "some row must stop early on EOS"
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=3)   # fewer slots than prompts
    for gamma in (0, 1, 3, 5):
        engine.reset_stats()
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), gamma=gamma)
        for out, ref in zip(outs, refs):
            assert out.token_ids == ref, f"gamma={gamma}"
            assert out.finish_reason == ("stop" if ref[-1] == eos else "length")
        if gamma:
            acc = engine.stats.acceptance_by_depth()
            assert 0 < acc[0] < 1, f"drafts must be partly accepted to exercise ragged steps: {acc}"
            assert sum(o.num_drafted_tokens for o in outs) > 0


def test_auto_gamma_matches_gamma_zero(root):
    """Past calibration (~500 row-steps; calibration takes 256): the policy decides from
    measured costs, and every gamma it picks leaves the greedy tokens those of gamma 0."""
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=1, draftable=0.1, with_tokenizer=False)
    prompts = random_prompts([4, 8, 2, 11, 6, 3] * 4, 128, seed=2)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=8)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    base = engine.generate(prompts, params, gamma=0)
    auto = engine.generate(prompts, params, gamma="auto")
    assert [o.token_ids for o in auto] == [o.token_ids for o in base]
    decisions = engine.last_policy.decisions
    calibrating = [d for d in decisions if not d.predicted_goodput]
    decided = [d for d in decisions if d.predicted_goodput and not d.measuring]
    assert calibrating and decided, "the call must leave calibration and decide from costs"
    assert len(decided) >= 5 and sum(o.num_drafted_tokens for o in auto) > 0


def test_gamma_changes_between_steps(root):
    """A policy that switches gamma every step (0 included) leaves greedy output unchanged."""
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=2, draftable=0.1, with_tokenizer=False)
    prompts = random_prompts([6, 3, 10, 5, 8], 128, seed=3)
    refs = hf_greedy(path, prompts, 20)

    class Cycle:
        def __init__(self):
            self.calls = 0

        def choose(self, ctx):
            self.calls += 1
            return [3, 0, 1, 5, 0, 2][self.calls % 6]

        def max_gamma(self):
            return 5

    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=2)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=20), gamma=Cycle())
    assert [o.token_ids for o in outs] == refs
    assert engine.stats.accepted[0] > 0


def test_auto_policy_records_a_decision_per_step(root):
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=1, draftable=0.05, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=8, gamma_max=4)
    prompts = random_prompts([4, 8, 2, 11, 6, 3] * 5, 128, seed=5)     # ~600 row-steps: past calibration
    engine.generate(prompts, SamplingParams(max_new_tokens=96, ignore_eos=True), gamma="auto")
    decisions = engine.last_policy.decisions
    steps = engine.last_stats.steps
    assert len(decisions) == len(steps) and [d.gamma for d in decisions] == [s.gamma for s in steps]
    assert "calibrating" in decisions[0].reason and decisions[0].gamma == 4
    decided = [d for d in decisions if d.predicted_goodput]
    assert decided, "after calibration the policy must decide from measured costs"
    margin = engine.last_policy.min_gain
    for d in decided:          # the argmax, or gamma 0 where the argmax gains within the margin,
        top = max(d.predicted_goodput)   # or while plain decoding is measured (or re-measured) at a shape,
        assert d.predicted_goodput[d.gamma] == top or (   # or, where gamma 0 was chosen, a speculative re-measure
            d.gamma == 0 and top <= d.predicted_goodput[0] * (1 + margin) and "margin" in d.reason) or (
            d.gamma == 0 and d.measuring and "measuring plain decoding" in d.reason) or (
            d.gamma > 0 and d.measuring and f"re-measuring gamma {d.gamma}" in d.reason
            and top <= d.predicted_goodput[0] * (1 + margin)) or (   # or exploring where the mean picks gamma 0
            d.gamma > 0 and d.exploring and f"exploring gamma {d.gamma}" in d.reason
            and top <= d.predicted_goodput[0] * (1 + margin)) or (   # or one depth past the argmax, exploring
            d.exploring and "one depth deeper" in d.reason and d.predicted_goodput[d.gamma - 1] == top) or (
            d.gamma > 0 and d.measuring and f"measuring gamma {d.gamma} at this shape" in d.reason   # or a near
            and top <= d.predicted_goodput[d.gamma] * (1 + margin))                  # tie, priced by its own steps
    assert any(not d.measuring for d in decided)


def test_auto_policy_sees_rows_near_their_budget_and_each_row_when_few(root):
    from pipeline.spec_decode.policy import FEW_ROWS, GoodputPolicy

    class Recording(GoodputPolicy):
        def choose(self, ctx):
            seen.append((ctx.rows, ctx.rows_apart))
            return super().choose(ctx)

    seen = []
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=1, draftable=0.05, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=FEW_ROWS + 2, gamma_max=3)
    base = engine.auto_policy()
    policy = Recording(base.gamma_max, base.cost)
    prompts = random_prompts([5, 7, 3, 9] * 5, 128, seed=2)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True), gamma=policy)
    assert all(len(o.token_ids) == 10 for o in outs)
    assert seen[0] == (FEW_ROWS + 2, ())                # many rows, 9 tokens left each: none apart
    for rows, apart in seen:
        assert list(apart) == sorted(apart) and len(apart) <= rows
        if rows <= FEW_ROWS:
            assert len(apart) == rows                   # few rows: each priced on its own
        else:
            assert all(1 <= left <= 3 for left, _, _ in apart)   # many: only those near their budget
        assert all(hits <= drafted for _, drafted, hits in apart)
    assert any(apart and rows > FEW_ROWS for rows, apart in seen)
    assert any(drafted > 0 for _, apart in seen for _, drafted, _ in apart)

    # one row at a time: a small batch (at most FEW_ROWS slots) has no tail, since its last prompt
    # runs with nothing queued all its length, and two early misses priced on its own would put
    # it at gamma 0 for good; a row is priced on its own only near its budget, the last one too
    seen.clear()
    engine.max_batch_size = 1
    engine.generate(prompts[:3], SamplingParams(max_new_tokens=10, ignore_eos=True), gamma=policy)
    assert len(seen) >= 3 and all(rows == 1 for rows, _ in seen)
    assert seen[0] == (1, ())                           # the first row, two more queued: typical
    assert any(apart for _, apart in seen)              # near its budget: apart
    assert all(1 <= left <= 3 for _, apart in seen for left, _, _ in apart)   # never while far (left 4)


@pytest.mark.parametrize("gamma", [0, 2])
def test_last_policy_decisions_exist_after_a_fixed_gamma(root, gamma):
    """README: `engine.last_policy.decisions` explains each step; a fixed gamma decides nothing."""
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=2)
    engine.generate(random_prompts([4, 6], 128, seed=1), SamplingParams(max_new_tokens=4), gamma=gamma)
    assert list(engine.last_policy.decisions) == []
    assert engine.last_policy.max_gamma() == gamma


@pytest.mark.parametrize("tied,kernel", [(False, "fbgemm"), (True, "fbgemm"), (False, "native"), (True, "native"),
                                         (False, "native-avx2")])
def test_greedy_matches_transformers_through_the_float16_weight_gemm(tmp_path, tied, kernel, monkeypatch, request):
    """Weights float16 holds (the demo's store stage) run every CPU linear, the output heads and
    the heads' draft vocabulary included, through a float16-weight GEMM (pipeline.model.packed:
    FBGEMM's up to 2 input rows, or the native half_gemm up to 12, one pass of 8 rows and one of
    the rest) and the float32 GEMM above; greedy output is still transformers' at every gamma.
    native-avx2: the C kernels' AVX2 build, where this CPU has AVX-512 (SPECBATCH_NATIVE_ISA)."""
    import torch

    from pipeline.demo.build import store_weights
    from pipeline.model import native, packed
    from pipeline.model.layers import Attention, RMSNorm
    from pipeline.model.packed import Fp16WeightLinear, PackedLinear, fp16_gemm_works
    from pipeline.model.tiny import make_tiny_checkpoint
    if kernel.startswith("native") and native.library() is None:
        pytest.skip("the native half_gemm does not build on this machine")
    if kernel == "native-avx2":
        if native.rows_per_pass() != 8:
            pytest.skip("this CPU has no AVX-512: the library is the AVX2 build already")
        monkeypatch.setenv("SPECBATCH_NATIVE_ISA", "avx2")
        native.library.cache_clear()
        request.addfinalizer(native.library.cache_clear)     # later tests load the default build
        assert native.rows_per_pass() == 6
        kernel = "native"
    if kernel == "fbgemm" and not fp16_gemm_works():
        pytest.skip("this torch build has no FBGEMM float16-weight GEMM")
    monkeypatch.setattr(packed, "fp16_kernel", lambda: kernel)
    rows = 2 if kernel == "fbgemm" else 12
    monkeypatch.setattr(packed, "fp16_gemm_rows", lambda *shape: rows)   # whatever this machine times
    path = make_tiny_checkpoint(tmp_path / "m", arch="llama", num_mtp_layers=2, draftable=0.1,
                                with_tokenizer=False, tie_word_embeddings=tied)
    store_weights(path, "bfloat16", log=lambda _: None)
    prompts = random_prompts(LENGTHS, 128, seed=2)
    refs = hf_greedy(str(path), prompts, MAX_NEW)
    engine = Engine.from_pretrained(str(path), device="cpu", max_batch_size=3)
    for head in engine.heads:
        head.set_draft_vocab(torch.arange(0, 128, 2))
    modules = [*engine.target.modules(), *(m for h in engine.heads for m in h.modules())]
    assert not any(type(m) in (PackedLinear, torch.nn.Linear) for m in modules)
    assert sum(isinstance(m, Fp16WeightLinear) for m in modules) == 4 * 2 + 1 + 5 * 2
    assert all(isinstance(h.draft_head, Fp16WeightLinear) for h in engine.heads)
    assert {m.kernel for m in modules if isinstance(m, Fp16WeightLinear)} == {kernel}
    if native.library() is not None:          # and the norms' and attention's C kernels, whichever GEMM
        assert all(m.native is not None for m in modules if isinstance(m, (RMSNorm, Attention)))
    layers = [*engine.target.model.layers, *engine.heads]
    assert all((layer.native_layer is not None) == (kernel == "native") for layer in layers)   # one C call a layer
    drafted_in_c = []
    greedy_c = native.mtp_greedy
    monkeypatch.setattr(native, "mtp_greedy", lambda *a, **k: drafted_in_c.append(a[2]) or greedy_c(*a, **k))
    for gamma in (0, 1, 3, 5, "auto"):
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), gamma=gamma)
        assert [o.token_ids for o in outs] == refs, f"gamma={gamma}"
    assert bool(drafted_in_c) == (kernel == "native")      # greedy drafts by the heads' C path


@pytest.mark.parametrize("arch,rope", [
    ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}),
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}),
])
def test_greedy_matches_transformers_with_scaled_rope(tmp_path, arch, rope):
    """Checkpoints with RoPE scaling (Llama 3's frequency bands; YaRN, whose tables also carry an
    attention scale) and bfloat16 weights, so the layers run as C calls on CPU: the rotary tables
    are transformers' own, and greedy output is still transformers' at every gamma and draft source."""
    import json

    from pipeline.demo.build import store_weights
    from pipeline.model import native
    from pipeline.model.tiny import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "m", arch=arch, num_mtp_layers=1, draftable=0.1, with_tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = rope
    (path / "config.json").write_text(json.dumps(config))
    store_weights(path, "bfloat16", log=lambda _: None)
    prompts = random_prompts([5, 40, 3, 70, 12], 128, seed=3)    # positions past 64 / 128 after 40 new
    refs = hf_greedy(str(path), prompts, 40)
    config.pop("rope_parameters")
    (path / "config.json").write_text(json.dumps(config))
    assert hf_greedy(str(path), prompts, 40) != refs, "the scaling must change what these prompts decode"
    config["rope_parameters"] = rope
    (path / "config.json").write_text(json.dumps(config))
    engine = Engine.from_pretrained(str(path), device="cpu", max_batch_size=3)
    assert engine.target.rotary.rope_type == rope["rope_type"]
    if native.library() is not None:
        assert all(layer.native_layer is not None for layer in engine.target.model.layers)
    for gamma, draft in [(0, "mtp"), (3, "mtp"), ("auto", "auto"), ("auto", "ngram")]:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=40), gamma=gamma, draft=draft)
        assert [o.token_ids for o in outs] == refs, (gamma, draft)


def test_greedy_matches_transformers_on_odd_shapes_through_the_c_layers(tmp_path):
    """Sizes no kernel's blocking divides (hidden 96 in 3 heads of 32, one KV head for three,
    an MLP of 200, a tied vocabulary of 1000) with bfloat16 weights, so every layer and head is a
    C call on CPU, and a 200-token prompt, prefilled in several pieces: transformers' greedy tokens
    at every gamma and draft source."""
    from pipeline.demo.build import store_weights
    from pipeline.model import native
    from pipeline.model.tiny import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "m", arch="llama", num_mtp_layers=2, draftable=0.1, with_tokenizer=False,
                                num_layers=3, hidden_size=96, num_heads=3, num_kv_heads=1, intermediate_size=200,
                                vocab_size=1000, tie_word_embeddings=True)
    store_weights(path, "bfloat16", log=lambda _: None)
    prompts = random_prompts([5, 40, 3, 200, 12], 1000, seed=0)
    refs = hf_greedy(str(path), prompts, 30)
    engine = Engine.from_pretrained(str(path), device="cpu", max_batch_size=4)
    if native.library() is not None:
        assert all(layer.native_layer is not None for layer in engine.target.model.layers)
    for gamma, draft in [(0, "mtp"), (2, "mtp"), (5, "mtp"), ("auto", "auto"), ("auto", "ngram")]:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=30), gamma=gamma, draft=draft)
        assert [o.token_ids for o in outs] == refs, (gamma, draft)
    assert engine.stats.accepted[0] > 0
