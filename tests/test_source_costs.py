"""Each draft source reports its own cost, and the cost model learns from every step: n-gram and
mixed steps are fitted (verify by the tokens computed, drafting by source), and the profile and
the step-cost bench time a checkpoint's sources through the drafter protocol."""
from dataclasses import replace

import pytest

from pipeline.bench.step_costs import measure, table
from pipeline.engine import Engine, SamplingParams
from pipeline.engine.costs import CostTracker
from pipeline.engine.profile import profile_costs
from pipeline.engine.drafting import DraftPlanner
from pipeline.spec_decode.cost import MIN_LOCAL, CostModel, cold, fit_cost_model
from pipeline.spec_decode.policy import FixedGamma
from pipeline.spec_decode.stats import StepRecord
from tests.test_drafters import MAX_NEW, repetitive_prompts
from tests.tiny_models import made_up_machine, tiny_checkpoint

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
    with made_up_machine():
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
        assert gamma_shaped == sum(s.query_len == 1 and not cold(s) for s in fed)   # a prefill's next steps: none
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


def heads_step(gamma: int, rows: int, ctx: float, fill: int, truth: CostModel = TRUTH) -> StepRecord:
    """A heads' step priced by `truth`, its fill over `fill` tokens (the last step's rows x width)."""
    return StepRecord(gamma, rows, gamma + 1, ctx, truth.verify_s(rows, gamma + 1, ctx),
                      truth.draft_s(rows, gamma, ctx, fill), 0, fill_tokens=fill)


def test_the_heads_fill_is_fitted_by_the_tokens_it_ran():
    """A heads' step fills the last step's verify, whatever its own gamma: 0 tokens after a plain
    step, rows x 9 after 8-wide n-gram drafts (a mixed call runs the heads shallow beside them).
    Fitted as rows x (gamma + 1), such steps made the fill's cost look like a depth's; fitted by
    the recorded fill, as the truth. Here a fill token costs 50 us and a depth 0.5 ms + 50 us a row."""
    truth = replace(TRUTH, draft_coef=(1e-3, 5e-5, 5e-4, 5e-5))
    steps = [heads_step(g, r, c, r * (g + 1), truth) for r in (1, 4, 16, 48) for g in (1, 2, 3, 4) for c in (64, 256)]
    steps += [heads_step(g, r, c, f, truth) for r in (16, 48) for g in (1, 2) for c in (64, 256) for f in (0, r * 9, r * 9)]
    model = fit_cost_model(steps)
    for g in range(1, 6):
        assert model.draft_s(48, g, 64) == pytest.approx(truth.draft_s(48, g, 64), rel=0.02)
    unrecorded = [StepRecord(s.gamma, s.rows, s.query_len, s.context_len, s.verify_s, s.draft_s, 0) for s in steps]
    blind = fit_cost_model(unrecorded)                   # what the fit made of the same steps before
    assert max(abs(blind.draft_s(48, g, 64) / truth.draft_s(48, g, 64) - 1) for g in range(1, 6)) > 0.2


def test_a_step_after_a_wider_one_prices_its_own_bucket():
    """The per-shape correction compares a step with the model at its gamma plus the fill it ran
    beyond that gamma's: gamma-1 steps that filled an 8-wide n-gram step's tokens correct their
    bucket as gamma-1 steps at their own fill do, not as dear gamma-1 steps."""
    truth = replace(TRUTH, draft_coef=(1e-3, 5e-5, 5e-4, 5e-5))
    uniform = [heads_step(g, r, c, r * (g + 1), truth) for r in (1, 4, 16, 48) for g in range(4) for c in (64, 256)]

    def factor(step: StepRecord) -> float:
        tracker = CostTracker()
        tracker.set_profile(uniform)
        tracker.model()
        for _ in range(MIN_LOCAL):
            tracker.record(step)
        return tracker.local.factor(1, 48, 64)

    own, wide = heads_step(1, 48, 64, 48 * 2, truth), heads_step(1, 48, 64, 48 * 9, truth)
    assert factor(wide) == pytest.approx(factor(own), rel=0.02)
    assert factor(replace(wide, fill_tokens=-1)) > 1.2 * factor(own)      # read as its own gamma's fill


def test_the_engine_records_the_tokens_the_heads_filled(tmp_path, monkeypatch):
    """Each heads' step records its fill: the previous step's rows x the most tokens any of them
    kept (1 after a plain step); 0 on a row's first drafted step (its prompt's fill is prefill
    work). The fill runs no wider than the most any row kept: the rest is masked."""
    from pipeline.engine.drafter import Drafter
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4, gamma_max=3)
    widths, original, original_column = [], Drafter.add_pending, Drafter.add_column

    def add_pending(self, fill):
        widths.append((fill.next_ids.shape[1], int(fill.count.max())))
        return original(self, fill)

    def add_column(self, n, start, hidden, next_ids):       # a step whose rows kept one token each
        widths.append((1, 1))
        return original_column(self, n, start, hidden, next_ids)

    monkeypatch.setattr(Drafter, "add_pending", add_pending)
    monkeypatch.setattr(Drafter, "add_column", add_column)

    class Schedule(FixedGamma):
        def __init__(self, gammas):
            super().__init__(max(gammas))
            self.gammas = iter(gammas)

        def choose(self, ctx):
            return next(self.gammas, 1)

    engine.generate([[5, 6, 7], [8, 9], [10, 11, 12], [13, 14]], SamplingParams(max_new_tokens=30, ignore_eos=True),
                    gamma=Schedule([2, 3, 0, 1, 1]), draft="mtp")
    s = engine.last_stats.steps
    assert [st.gamma for st in s[:5]] == [2, 3, 0, 1, 1]
    assert all(w == kept for w, kept in widths)
    assert s[0].fill_tokens == 0                         # the prompts' fill is prefill work
    assert s[1].fill_tokens == s[0].rows * widths[0][0]
    assert s[2].fill_tokens == -1                        # no heads
    assert s[3].fill_tokens == s[2].rows                 # a plain step's one token a row
    assert s[4].fill_tokens == s[3].rows * widths[3][0]


def test_a_standing_plain_decision_is_asked_only_where_no_row_was_admitted_since(tmp_path):
    """The run loop asks `plain_stands` before building the policy's inputs, except on the
    first step after rows are admitted: a fresh row has its budget ahead of it, which a plain
    decision made near another row's end did not price. Batch 1, three prompts: `choose` runs
    once per admitted row, `plain_stands` on every other step."""
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=1, gamma_max=3)

    class Standing(FixedGamma):
        def __init__(self):
            super().__init__(3)
            object.__setattr__(self, "asked", [])

        def choose(self, ctx):
            self.asked.append("choose")
            return 0

        def plain_stands(self, rows, context_len):
            self.asked.append("stands")
            return True

    policy = Standing()
    engine.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], SamplingParams(max_new_tokens=5, ignore_eos=True),
                    gamma=policy, draft="mtp")
    steps = len(engine.last_stats.steps)
    assert steps == 12 and policy.asked == ["choose", "stands", "stands", "stands"] * 3
