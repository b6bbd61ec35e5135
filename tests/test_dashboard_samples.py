"""The stats row's cost-model evidence (pipeline/cluster/step_samples.py): capped samples and the
predicted gamma-0 tokens/s of the module docstring's worked example."""
import pytest

from pipeline.cluster.step_samples import cost_samples, predicted_gamma0_tokens_per_s, shard_cost_model
from pipeline.spec_decode.cost import CostModel
from pipeline.spec_decode.stats import StepRecord


def step(rows=4, gamma=2, verify=0.06, draft=0.02, emitted=5, ctx=10.0):
    return StepRecord(gamma, rows, gamma + 1, ctx, verify, draft, emitted)


def test_worked_example():
    model = CostModel((0.04, 0.005, 0.0, 0.0), 0.0, (0.0, 0.0, 0.0, 0.0), 3)   # 0.04 + 0.005 N
    tps = predicted_gamma0_tokens_per_s([step()] * 20, model, generated=100, wall_s=2.0)
    assert tps == pytest.approx(100 / (2.0 - 1.6 + 0.9))


def test_gamma0_steps_predict_what_was_measured():
    """At gamma 0 the prediction is the measurement itself: scale makes the model agree."""
    model = CostModel((0.01, 0.001, 0.0, 0.0), 0.0, (0.0,) * 4, 3)
    steps = [step(rows=r, gamma=0, verify=0.002 * r, draft=0.0, emitted=r) for r in (4, 3, 2)]
    assert predicted_gamma0_tokens_per_s(steps, model, 9, 0.5) == pytest.approx(9 / 0.5)


def test_no_model_or_no_steps_is_none():
    assert predicted_gamma0_tokens_per_s([step()], None, 10, 1.0) is None
    model = CostModel((0.05, 0.0, 0.0, 0.0), 0.0, (0.0,) * 4, 3)
    assert predicted_gamma0_tokens_per_s([], model, 10, 1.0) is None


def test_samples_are_capped_evenly_and_stand_ins_are_skipped():
    steps = [step(rows=1 + i % 7, verify=0.001 * (i + 1)) for i in range(200)]
    samples = cost_samples(steps, cap=64)
    assert len(samples) == 64
    assert samples[0] == [1, 3, 10.0, 0.001, 0.02]
    assert [s[3] for s in samples] == sorted(s[3] for s in samples)     # spaced over the call
    assert samples[-1][3] > 0.19                                          # reaches the end
    assert cost_samples([object(), object()]) == []


def test_shard_model_falls_back_to_a_fit_over_the_steps():
    steps = [step(rows=r, verify=0.01 + 0.002 * r * 3) for r in (1, 2, 4, 8) for _ in range(3)]
    model = shard_cost_model(object(), steps)
    assert model is not None and model.verify_s(8, 3, 10.0) == pytest.approx(0.058, rel=0.05)
