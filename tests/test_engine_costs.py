"""When the engine's cost knowledge goes stale: drift of measured steps, or a utilisation jump."""
import random

import pytest

from pipeline.engine import Engine
from pipeline.engine.costs import CostTracker
from pipeline.spec.cost import CostModel, fit_cost_model
from pipeline.spec.stats import StepRecord
from tests.tiny_models import tiny_checkpoint

TRUTH = CostModel((5e-3, 2e-6, 40e-6, 1e-9), 128, (1e-3, 2e-6, 5e-4, 3e-6), 0)


def records(scale=1.0, seed=0):
    rng = random.Random(seed)
    out = []
    for rows in (1, 4, 16, 64):
        for gamma in range(4):
            for ctx in (64, 256):
                f = scale * (1 + rng.uniform(-0.05, 0.05))
                out.append(StepRecord(gamma, rows, gamma + 1, ctx, ctx, TRUTH.verify_s(rows, gamma + 1, ctx) * f,
                                      TRUTH.draft_s(rows, gamma) * f, 0))
    return out


def test_steps_that_match_the_model_keep_it():
    tracker = CostTracker(window=32)
    tracker.set_profile(records())
    assert tracker.model() is not None
    tracker.observe(records(seed=1) * 2)
    assert tracker.stale_reason is None and not tracker.needs_profile()


def test_drifted_steps_mark_the_model_stale_and_a_new_profile_resets():
    tracker = CostTracker(window=32)
    tracker.set_profile(records())
    tracker.model()
    tracker.observe(records(scale=3.0, seed=2) * 2)
    assert tracker.needs_profile() and "x the cost model" in tracker.stale_reason
    tracker.set_profile(records(scale=3.0))
    assert not tracker.needs_profile() and tracker.profiles_taken == 2 and not tracker.steps


def test_a_utilisation_jump_marks_the_model_stale():
    tracker = CostTracker()
    tracker.set_profile(records())
    tracker.note_utilization(0.30)
    tracker.note_utilization(0.45)
    assert not tracker.needs_profile()
    tracker.note_utilization(0.95)
    assert tracker.needs_profile() and "0.30 to 0.95" in tracker.stale_reason


def test_engine_reprofiles_when_stale(tmp_path):
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4, gamma_max=2)
    engine.auto_policy()
    assert engine.costs.profiles_taken == 1 and engine.cost_model() is not None
    engine.auto_policy()
    assert engine.costs.profiles_taken == 1                 # fresh knowledge is reused
    engine.note_utilization(0.1)
    engine.note_utilization(0.9)
    engine.auto_policy()
    assert engine.costs.profiles_taken == 2


def test_engine_measures_each_steps_overhead_and_the_model_carries_it(tmp_path):
    from pipeline.engine import SamplingParams
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4, gamma_max=2)
    engine.generate([[5, 6, 7], [8, 9]] * 3, SamplingParams(max_new_tokens=12, ignore_eos=True), gamma="auto")
    steps = engine.last_stats.steps
    assert steps and all(s.overhead_s > 0 for s in steps)
    model = fit_cost_model(steps, profile=engine.costs.profile)    # what the next refit gives
    assert sum(model.overhead_coef) > 0
    s = steps[-1]
    assert model.modelled_step_s(s.rows, s.gamma, s.context_len) == pytest.approx(
        model.compute_s(s.rows, s.gamma, s.context_len) + model.overhead_s(s.rows))
    assert model.step_s(s.rows, s.gamma, s.context_len) == pytest.approx(
        model.modelled_step_s(s.rows, s.gamma, s.context_len) * model.local_factor(s.rows, s.gamma))
