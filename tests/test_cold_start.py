"""A fresh engine's first gamma="auto" call starts warm: the checkpoint's spec_prior.json means
no calibration, and the cost profile comes from the on-disk cache (counted, never timed)."""
import shutil

import pytest

from pipeline.engine import Engine, SamplingParams
from pipeline.model.spec_prior import write_spec_prior
from pipeline.spec_decode.cost import MIN_LOCAL, LocalCorrection
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
    assert warm.last_policy.prior.reached[0] >= warm.last_policy.calibration_rows
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
    assert [(r.rows, r.gamma) for r in second.costs.profile] == [(r.rows, r.gamma) for r in first.costs.profile]
    other = Engine.from_pretrained(bare, device="cpu", max_batch_size=2, gamma_max=2)   # other shapes: measured
    other.ensure_profile()
    assert len(calls) == 1


def test_a_small_first_call_with_no_profile_anywhere_measures_on_its_own_steps(shipped, monkeypatch):
    """No profile in memory or on disk and a call of a few rows: no bare forwards are timed; the
    policy runs gamma 0, 1 and 2 on real steps, fits the cost model from them and decides from
    it. The tokens are gamma 0's (greedy)."""
    _, with_prior = shipped
    import pipeline.engine.warm_start as warm_start
    calls = []
    real_profile = warm_start.profile_costs
    monkeypatch.setattr(warm_start, "profile_costs", lambda *a, **k: calls.append(a) or real_profile(*a, **k))
    prompts = random_prompts([5, 9, 3, 7], 128, seed=4)
    engine = first_auto_call(with_prior, prompts)
    decisions = engine.last_policy.decisions
    assert calls == [] and engine.costs.profiles_taken == 0 and not engine.costs.profile
    assert [d.gamma for d in decisions[:3]] == [0, 1, 2]
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
