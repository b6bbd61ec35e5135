"""Each draft source reports its own cost, and the cost model learns from every step: n-gram and
mixed steps are fitted (verify by the tokens computed, drafting by source), and the profile and
the step-cost bench time a checkpoint's sources through the drafter protocol."""
import pytest

from pipeline.bench.step_costs import measure, table
from pipeline.engine import Engine, SamplingParams
from pipeline.engine.costs import CostTracker
from pipeline.engine.profile import profile_costs
from pipeline.engine.drafting import DraftPlanner
from pipeline.spec_decode.cost import MIN_LOCAL, CostModel, fit_cost_model
from pipeline.spec_decode.policy import FixedGamma
from pipeline.spec_decode.stats import StepRecord
from tests.test_drafters import MAX_NEW, repetitive_prompts
from tests.tiny_models import tiny_checkpoint

TRUTH = CostModel((5e-3, 2e-6, 40e-6, 1e-9), 128, (1e-3, 2e-6, 5e-4, 3e-6), 0, lookup_row_s=4e-6)


def truth_step(gamma: int, rows: int, q: float, ctx: float, looked: bool) -> StepRecord:
    """A step priced by TRUTH: verify by its tokens, the heads by their depth, a lookup by its rows."""
    lookup = TRUTH.lookup_s(rows) if looked else 0.0
    return StepRecord(gamma, rows, q, ctx, TRUTH.verify_s(rows, q, ctx), TRUTH.draft_s(rows, gamma, ctx) + lookup,
                      0, lookup_s=lookup)


def test_mixed_steps_are_fitted_by_tokens_and_by_source():
    uniform = [truth_step(g, r, g + 1, c, False) for r in (1, 4, 16, 64) for g in range(4) for c in (64, 256)]
    ragged = [truth_step(g, r, q, c, True) for r in (2, 8, 32) for g in (0, 2) for q in (1.5, 2.75) for c in (64, 256)]
    model = fit_cost_model(uniform + ragged)
    assert model.lookup_row_s == pytest.approx(TRUTH.lookup_row_s)
    for s in ragged:              # the heads' part is what is left once the lookup is taken out
        assert model.verify_s(s.rows, s.query_len, s.context_len) == pytest.approx(s.verify_s, rel=1e-3)
        assert model.draft_s(s.rows, s.gamma, s.context_len) == pytest.approx(
            TRUTH.draft_s(s.rows, s.gamma, s.context_len), rel=1e-3)

    tracker = CostTracker()
    tracker.set_profile(uniform)
    tracker.model()
    for s in ragged:
        tracker.record(s, by_gamma=False)
    assert len(tracker.steps) == len(ragged) and not tracker.local.samples and not tracker.ratios


def test_a_padded_verify_width_is_priced_as_measured_at_that_width():
    """The smooth fit prices n-gram drafts' padded verifies until steps at that width measure
    them: 48 rows with two likely drafts each verify 3 tokens a row while TRUTH prices it, and
    none once such verifies measure 4x (every row's P sums to 1.0: 2x the tokens for 4.7x the
    step)."""
    uniform = [truth_step(g, r, g + 1, c, False) for r in (1, 4, 16, 64) for g in range(4) for c in (64, 256)]
    tracker = CostTracker()
    tracker.set_profile(uniform)
    planner = DraftPlanner({}, True, 4, None, tracker.model, None, layout="padded")
    p = [[0.6, 0.4]] * 48
    assert planner._lengths(p, 48, 64.0) == [2] * 48
    for _ in range(MIN_LOCAL):
        tracker.record(truth_step(0, 48, 1, 64, False))
        tracker.record(truth_step(0, 48, 2.5, 64, True), by_gamma=False)   # a packed verify: no width's price
        slow = truth_step(0, 48, 3, 64, True)
        slow.verify_s *= 4
        tracker.record(slow, by_gamma=False)
    assert {k[0] for k in tracker.verify_local.factors} == {1, 3}
    assert tracker.model().measured_verify_s(48, 3, 64.0) == pytest.approx(4 * TRUTH.verify_s(48, 3, 64.0), rel=0.02)
    assert planner._lengths(p, 48, 64.0) == [0] * 48


@pytest.mark.parametrize("heads,draft,gamma", [(0, "ngram", "auto"), (1, "auto", FixedGamma(2))])
def test_steps_with_ngram_rows_reach_the_cost_model(tmp_path, heads, draft, gamma):
    """n-gram rows alone (a checkpoint without heads, auto), and beside the heads' rows (mixed)."""
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=heads, draftable=0.1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=3)
    engine.costs.refit_every, engine.costs.refit_share = 1, float("inf")     # refit whenever a step counts
    engine.generate(repetitive_prompts(seed=2), SamplingParams(max_new_tokens=MAX_NEW), gamma=gamma, draft=draft)
    steps, fed = engine.last_stats.steps, list(engine.costs.steps)
    assert engine.last_stats.drafted_by_source.get("ngram", 0) > 0
    assert len(fed) == len(steps)                                  # every step is a sample, n-gram rows or not
    assert any(s.lookup_s > 0 for s in fed)                        # the n-gram source timed its own lookups
    gamma_shaped = sum(len(v) for v in engine.costs.local.samples.values())
    assert gamma_shaped < len(steps)                               # n-gram rows: no gamma's shape
    assert fit_cost_model(fed, profile=engine.costs.profile).lookup_row_s > 0
    if heads:                                                      # the heads' depth as they ran
        assert {s.gamma for s in fed} <= {0, 2} and any(s.gamma == 2 and s.lookup_s > 0 for s in fed)
    else:                                                          # the per-row choice refits from them
        assert {s.gamma for s in fed} == {0} and any(s.query_len > 1 for s in fed)
        assert gamma_shaped == sum(s.query_len == 1 for s in fed)
        assert engine.costs.fits > 1


def test_profile_and_bench_time_the_sources_of_a_checkpoint_without_heads(tmp_path):
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=0, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=2, gamma_max=2)
    assert engine.draft_names == ("ngram",) and [s.name for s in engine.draft_sources(2, 64)] == ["ngram"]
    records = profile_costs(engine, 2, 2)
    assert all(r.verify_s > 0 for r in records)
    looked = [r for r in records if r.gamma == 2]
    assert looked and all(r.lookup_s > 0 and r.draft_s == r.lookup_s for r in looked)
    assert all(r.draft_s == 0 for r in records if r.gamma < 2)
    assert fit_cost_model(records).lookup_row_s > 0
    costs = measure(engine, rows=2, ctx=16, q_max=3, reps=1, draft_gammas=(1, 2))
    assert costs.draft_s == {} and costs.lookup_row_s["ngram"] > 0 and set(costs.verify_s) == {1, 2, 3}
    assert "lookup us/row" in table([costs])
