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


MULTI = CostModel((0.004, 0.0005, 0.0002, 1e-6), 24.0, (0.001, 0.0002, 0.0005, 0.0001), 40,
                  multi_token_s=0.003, draft_ctx_s=1e-7, overhead_coef=(0.0004, 0.00001))


def test_cost_model_round_trips_through_a_stats_row():
    """The worker writes CostModel.to_dict (as JSON) and the dashboard rebuilds it with from_dict:
    every term survives, the multi-token one included."""
    import json

    from pipeline.cluster.step_samples import cost_model_json

    back = CostModel.from_dict(json.loads(cost_model_json(MULTI)))
    assert back == MULTI
    for rows, gamma, ctx in [(1, 0, 10.0), (4, 2, 100.0), (32, 5, 300.0)]:
        assert back.modelled_step_s(rows, gamma, ctx) == MULTI.modelled_step_s(rows, gamma, ctx)
    assert cost_model_json(None) is None


def test_dashboard_line_is_the_models_own_verify_time():
    """The dashboard's "policy's model" line is the model the policy prices with: at the samples'
    tokens per row (q = 3) it carries the multi-token term."""
    from pipeline.cluster.step_samples import cost_model_json
    from pipeline.dashboard.timeline import cost_figure

    samples = [[rows, 3, 100.0, MULTI.verify_s(rows, 3, 100.0), 0.001] for rows in (1, 2, 4, 8)]
    row = {"device": "cpu", "finished_at": 1.0, "cost_samples": samples, "cost_model": cost_model_json(MULTI)}
    line = next(t for t in cost_figure([row]).data if t.name.startswith("policy's model (cpu)"))
    for n, y in zip(line.x, line.y):
        assert y == pytest.approx(MULTI.verify_s(n / 3, 3, 100.0) * 1e3)
        assert y == pytest.approx((MULTI.compute_s(n / 3, 2, 100.0) - MULTI.draft_s(n / 3, 2, 100.0)) * 1e3)
    no_m = CostModel.from_dict(MULTI.to_dict() | {"multi_token_s": 0.0})
    assert line.y[0] == pytest.approx((no_m.verify_s(line.x[0] / 3, 3, 100.0) + 0.003) * 1e3)
