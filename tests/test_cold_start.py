"""A fresh engine's first gamma="auto" call starts warm: the checkpoint's spec_prior.json means
no calibration, and the cost profile comes from the on-disk cache (counted, never timed)."""
import shutil

import pytest

from pipeline.engine import Engine, SamplingParams
from pipeline.model.spec_prior import write_spec_prior
from pipeline.spec_decode.cost import MIN_LOCAL, LocalCorrection
from pipeline.spec_decode.evidence import PRIOR_ROW_STEPS
from tests.tiny_models import random_prompts, tiny_checkpoint


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    path = tiny_checkpoint(str(tmp_path / "models"), arch="llama", num_mtp_layers=1, draftable=0.05,
                           with_tokenizer=False)
    copy = tmp_path / "with-prior"
    shutil.copytree(path, copy)
    write_spec_prior(copy, {"t": ([2000, 1500, 1200, 1000], [1500, 1200, 1000, 800])}, "constructed", 4)
    return path, copy


def first_auto_call(path, prompts):
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=1, gamma_max=4)
    engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), gamma="auto")
    return engine


def test_a_fresh_engine_with_a_shipped_prior_never_calibrates(shipped):
    bare, with_prior = shipped
    prompts = random_prompts([5, 9, 3, 7], 128, seed=3)
    cold = first_auto_call(bare, prompts)
    calibrating = [d for d in cold.last_policy.decisions if d.calibrating]
    assert calibrating and len(calibrating) <= cold.last_policy.calibration_rows    # bounded: row-steps at batch 1
    warm = first_auto_call(with_prior, prompts)
    decisions = warm.last_policy.decisions
    assert not any(d.calibrating for d in decisions)
    assert warm.last_policy.calibrated and warm.last_policy.prior.reached[0] > 0
    assert warm.costs.profiles_taken == 0 and not warm.last_policy.plain_first   # priced by its own steps
    shapes = {LocalCorrection.key(0, s.rows, s.context_len) for s in warm.last_stats.steps}
    measuring = sum(1 for d in decisions if d.measuring)
    assert measuring <= MIN_LOCAL * len(shapes) + MIN_LOCAL        # plain decoding measured once per shape


def test_a_fresh_engine_takes_its_profile_from_the_disk_cache(shipped, monkeypatch):
    bare, _ = shipped
    first = Engine.from_pretrained(bare, device="cpu", max_batch_size=2, gamma_max=3)
    first.ensure_profile()
    assert first.costs.profiles_taken == 1 and not first.costs.profile_cached

    import pipeline.engine.warm_start as engine_module
    calls = []
    monkeypatch.setattr(engine_module, "profile_costs", lambda *a, **k: calls.append(a) or [])
    second = Engine.from_pretrained(bare, device="cpu", max_batch_size=2, gamma_max=3)
    second.ensure_profile()
    assert calls == [] and second.costs.profile_cached
    assert second.auto_policy().plain_first           # profiled: plain decoding measured at a shape first
    assert [(r.rows, r.gamma) for r in second.costs.profile] == [(r.rows, r.gamma) for r in first.costs.profile]
    other = Engine.from_pretrained(bare, device="cpu", max_batch_size=2, gamma_max=2)   # other shapes: measured
    other.ensure_profile()
    assert len(calls) == 1


def test_a_small_first_call_with_no_profile_anywhere_measures_on_its_own_steps(shipped, monkeypatch):
    """No profile in memory or on disk and a call of a few rows: no bare forwards are timed; the
    policy runs gamma 0, gamma_max (4) and 2 on real steps, so the fit spans every width it prices,
    fits the cost model from them and decides from it. The tokens are gamma 0's (greedy)."""
    _, with_prior = shipped
    import pipeline.engine.warm_start as warm_start
    calls = []
    real_profile = warm_start.profile_costs
    monkeypatch.setattr(warm_start, "profile_costs", lambda *a, **k: calls.append(a) or real_profile(*a, **k))
    prompts = random_prompts([5, 9, 3, 7], 128, seed=4)
    engine = first_auto_call(with_prior, prompts)
    decisions = engine.last_policy.decisions
    assert calls == [] and engine.costs.profiles_taken == 0 and not engine.costs.profile
    assert [d.gamma for d in decisions[:3]] == [0, 4, 2]
    assert all(d.measuring and not d.predicted_goodput for d in decisions[:3])
    assert any(d.predicted_goodput for d in decisions[3:])          # priced by the model the steps fitted
    plain = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), gamma=0)
    fresh = Engine.from_pretrained(with_prior, device="cpu", max_batch_size=1, gamma_max=4)
    again = fresh.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), gamma="auto")
    assert [o.token_ids for o in again] == [o.token_ids for o in plain]

    big = Engine.from_pretrained(with_prior, device="cpu", max_batch_size=16, gamma_max=4)
    big.generate(random_prompts([5] * 16, 128, seed=5), SamplingParams(max_new_tokens=4), gamma="auto")
    assert big.costs.profiles_taken == 1 and calls              # a call of 16 rows is profiled


def test_the_profile_cache_is_keyed_by_the_step_code(shipped, monkeypatch):
    """A profile measured by other engine code is not reused: the key holds a hash of the step's source."""
    import pipeline.engine.warm_start as ws
    bare, _ = shipped
    engine = Engine.from_pretrained(bare, device="cpu", max_batch_size=1, gamma_max=2)
    key = ws.profile_key(engine, 128)
    assert key == ws.profile_key(engine, 128) and len(ws.code_fingerprint()) == 24
    monkeypatch.setattr(ws, "code_fingerprint", lambda: "an older engine")
    assert ws.profile_key(engine, 128) != key


def test_the_profile_cache_is_keyed_by_the_cpu_kernels(shipped, monkeypatch):
    """The same code on the same CPU with the C kernels switched off (SPECBATCH_NATIVE=0, no
    compiler) or built for another vector width steps at other prices: its profile is not reused."""
    import pipeline.engine.warm_start as ws
    from pipeline.model import native
    bare, _ = shipped
    engine = Engine.from_pretrained(bare, device="cpu", max_batch_size=1, gamma_max=2)
    built = native.library() is not None
    key = ws.profile_key(engine, 128)
    monkeypatch.setenv("SPECBATCH_NATIVE", "0")
    native.library.cache_clear()
    try:
        assert ws.cpu_kernels() == "native:0|fp16:fbgemm"
        assert (ws.profile_key(engine, 128) != key) == built
    finally:
        monkeypatch.delenv("SPECBATCH_NATIVE")
        native.library.cache_clear()
    monkeypatch.setattr(native, "rows_per_pass", lambda: 6)
    six = ws.profile_key(engine, 128)
    monkeypatch.setattr(native, "rows_per_pass", lambda: 8)
    assert six != ws.profile_key(engine, 128)


def test_a_pooled_prior_of_tasks_far_apart_is_light_and_still_skips_calibration(tmp_path):
    """The checkpoint's "*" prior is what a call of unknown task starts from. Its tasks' a_1 differ
    (0.5 and 0.9), so it weighs a few dozen row-steps, not its 4,000: a call whose drafts are
    accepted at 0.9 moves the estimate there within its own steps, and still never calibrates."""
    from pipeline.engine.warm_start import checkpoint_prior
    from pipeline.spec_decode.evidence import PRIOR_ROW_STEPS
    from pipeline.spec_decode.policy import GoodputPolicy, StepContext, estimate_acceptance
    from pipeline.spec_decode.stats import SpecStats

    far = tmp_path / "far"
    far.mkdir()
    write_spec_prior(far, {"a": ([2000, 1000], [1000, 500]), "b": ([2000, 1800], [1800, 1620])}, "constructed", 2)
    prior = checkpoint_prior(far)
    assert 1 <= prior.reached[0] < 32                                  # m 0.7, spread 0.04: n = 4
    assert abs(prior.accepted[0] / prior.reached[0] - 2800 / 4000) < 1e-9   # ratios kept exactly
    near = tmp_path / "near"
    near.mkdir()
    write_spec_prior(near, {"a": ([2000], [1400]), "b": ([2000], [1410])}, "constructed", 1)
    assert checkpoint_prior(near).reached[0] == PRIOR_ROW_STEPS        # tasks that agree: a full-weight prior

    own = SpecStats([40, 36], [36, 32])                               # this call: a_1 = 0.9 over 40 row-steps
    acc = estimate_acceptance(_plus(prior.reached, own.reached), _plus(prior.accepted, own.accepted), 2)
    heavy = estimate_acceptance([4000 + 40, 2800 + 36], [2800 + 36, 2120 + 32], 2)   # the counts at full weight
    assert acc[0] >= 0.84 and heavy[0] < 0.71
    policy = GoodputPolicy(2, lambda: None, prior, calibrated=True)
    policy.choose(StepContext(rows=1, context_len=16.0, stats=SpecStats()))
    assert not policy.decisions[-1].calibrating


def _plus(a, b):
    return [x + y for x, y in zip(a, b)]


def test_a_named_task_starts_from_its_own_shipped_acceptance(tmp_path, monkeypatch):
    """generate(task=T) on a fresh engine: the policy's prior is T's held-out acceptance (as the
    driver's plan weighs it), not every task pooled; an unnamed or unknown task gets the file's
    tasks as a mixture (pipeline.spec_decode.prior_mix), the pool one component of it."""
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    path = tiny_checkpoint(str(tmp_path / "models"), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    copy = tmp_path / "two-tasks"
    shutil.copytree(path, copy)
    write_spec_prior(copy, {"easy": ([4000, 3600], [3600, 3200]), "hard": ([4000, 1000], [1000, 300])},
                     "constructed", 2)
    prompts = random_prompts([5, 9], 128, seed=5)

    def prior_a1(task, shipped=True):
        engine = Engine.from_pretrained(copy, device="cpu", max_batch_size=2, gamma_max=2)
        if not shipped:
            engine.spec_prior = None        # the shipped prior turned off (cold_start.py --no-prior)
        engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True), gamma="auto", task=task)
        policy = engine.last_policy
        if policy.mixture is not None:
            assert not policy.prior.reached          # the mixture stands in for the shipped counts
            return {name: (c[1][0] / c[0][0], c[0][0]) for name, c in policy.mixture.components}
        if not policy.prior.reached:
            return None
        return policy.prior.accepted[0] / policy.prior.reached[0], policy.prior.reached[0]

    easy, hard, pooled, unknown = prior_a1("easy"), prior_a1("hard"), prior_a1(None), prior_a1("other")
    assert easy[0] == pytest.approx(0.9) and hard[0] == pytest.approx(0.25)
    assert easy[1] == hard[1] == PRIOR_ROW_STEPS
    assert pooled == unknown and set(pooled) == {"easy", "hard", "*"}
    assert pooled["easy"] == easy and pooled["hard"] == hard
    assert pooled["*"][0] == pytest.approx((3600 + 1000) / 8000)
    assert pooled["*"][1] < 10          # two tasks this far apart make a weak pooled component
    assert prior_a1("easy", shipped=False) is None and prior_a1(None, shipped=False) is None
