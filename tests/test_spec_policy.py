"""The gamma policy and cost model, from constructed costs and acceptances."""
import random
from dataclasses import replace

import pytest
import torch

from pipeline.spec_decode.cost import MIN_LOCAL, REVISIT_STEPS, CostModel, LocalCorrection, context_bucket, fit_cost_model
from pipeline.spec_decode.policy import (ROW_PRIOR, Decision, GoodputPolicy, StepContext, choose_gamma, estimate_acceptance,
                                  expected_tokens, row_acceptance, upper_acceptance)
from pipeline.spec_decode.stats import SpecStats, StepRecord

GMAX = 5


def model(a=0.0, b=0.0, h=0.0, knee=0.0, c=0.0, draft=(0.0, 0.0, 0.0, 0.0)) -> CostModel:
    return CostModel((a, b, h, c), knee, draft, 0)


# memory-bound until 256 tokens per forward, then compute-bound (an accelerator's roofline)
ROOFLINE = model(a=10e-3, b=1e-6, h=50e-6, knee=256, draft=(0.2e-3, 1e-6, 0.3e-3, 1e-6))


def test_expected_tokens():
    assert expected_tokens([0.8, 0.5], 2) == pytest.approx(2.2)
    assert expected_tokens([0.8, 0.5], 0) == 1.0


def test_high_acceptance_and_idle_compute_gives_large_gamma():
    d = choose_gamma(ROOFLINE, [0.9] * GMAX, rows=1, ctx=100, gamma_max=GMAX)
    assert d.gamma == GMAX


def test_low_acceptance_gives_zero():
    cost = model(a=10e-3, b=0.5e-3, draft=(1e-3, 1e-5, 1e-3, 1e-5))
    assert choose_gamma(cost, [0.05] * GMAX, rows=4, ctx=100, gamma_max=GMAX).gamma == 0


def test_compute_bound_cost_gives_zero():
    # every token costs the same: gamma + 1 tokens cost gamma + 1 times one, and drafts cost extra
    cost = model(b=1e-4, draft=(1e-4, 1e-6, 1e-4, 1e-6))
    assert choose_gamma(cost, [0.8] * GMAX, rows=64, ctx=100, gamma_max=GMAX).gamma == 0
    assert choose_gamma(ROOFLINE, [0.6] * GMAX, rows=512, ctx=100, gamma_max=GMAX).gamma == 0


@pytest.mark.parametrize("acc", [0.3, 0.6, 0.9])
def test_shrinking_batch_never_lowers_gamma(acc):
    gammas = [choose_gamma(ROOFLINE, [acc] * GMAX, rows=r, ctx=200, gamma_max=GMAX).gamma for r in range(256, 0, -1)]
    assert all(later >= earlier for earlier, later in zip(gammas, gammas[1:])), gammas
    assert gammas[0] < gammas[-1]       # the sweep does cross from small to large gamma


def test_choice_is_argmax_of_stated_goodput():
    acc = [0.8, 0.7, 0.6, 0.5, 0.4]
    d = choose_gamma(ROOFLINE, acc, rows=48, ctx=300, gamma_max=GMAX)
    assert d.candidates == list(range(GMAX + 1))
    for g, gp in zip(d.candidates, d.predicted_goodput):
        assert gp == pytest.approx(48 * expected_tokens(acc, g) / ROOFLINE.step_s(48, g, 300))
    assert d.predicted_goodput[d.gamma] == max(d.predicted_goodput)
    assert f"gamma={d.gamma}" in d.reason or "no gamma" in d.reason


def test_fit_recovers_a_hinge_cost():
    truth = model(a=5e-3, b=2e-6, h=40e-6, knee=128, c=1e-9, draft=(1e-3, 2e-6, 5e-4, 3e-6))
    rng = random.Random(0)
    steps = []
    for rows in (1, 2, 4, 8, 16, 32, 64):
        for gamma in range(GMAX + 1):
            for ctx in (64, 512):
                noise = 1 + rng.uniform(-0.02, 0.02)
                steps.append(StepRecord(gamma, rows, gamma + 1, ctx, truth.verify_s(rows, gamma + 1, ctx) * noise,
                                        truth.draft_s(rows, gamma) * noise, 0))
    fit = fit_cost_model(steps)
    for rows in (1, 8, 48):
        for gamma in range(GMAX + 1):
            assert fit.step_s(rows, gamma, 300) == pytest.approx(truth.step_s(rows, gamma, 300), rel=0.08)


def test_fit_recovers_a_draft_cost_that_grows_with_context():
    truth = replace(model(a=5e-3, b=2e-6, c=1e-9, draft=(1e-3, 2e-6, 5e-4, 3e-6)), draft_ctx_s=2e-8)
    steps = [StepRecord(g, r, g + 1, ctx, truth.verify_s(r, g + 1, ctx), truth.draft_s(r, g, ctx), 0)
             for r in (1, 4, 16, 48) for g in range(GMAX + 1) for ctx in (64, 256)]
    fit = fit_cost_model(steps)
    for rows, gamma, ctx in ((1, 1, 100), (9, 1, 150), (48, 5, 400)):
        assert fit.draft_s(rows, gamma, ctx) == pytest.approx(truth.draft_s(rows, gamma, ctx), rel=0.05)
    grows = fit.draft_s(9, 1, 400) - fit.draft_s(9, 1, 64)          # the context term itself
    assert grows == pytest.approx(truth.draft_s(9, 1, 400) - truth.draft_s(9, 1, 64), rel=0.1) and grows > 0


def test_fit_needs_several_shapes():
    assert fit_cost_model([StepRecord(0, 1, 1, 10, 1e-3, 0, 1)]) is None


def test_estimate_acceptance_prior_and_chaining():
    est = estimate_acceptance([100, 80], [80, 40], depth=3, prior_mean=0.5, prior_weight=4)
    assert est[0] == pytest.approx((80 + 2) / 104)
    assert est[1] == pytest.approx((40 + 4 * est[0]) / 84)
    assert est[2] == pytest.approx(est[1])          # unobserved depth: the previous depth's estimate


def test_policy_calibrates_unseen_task_then_decides():
    policy = GoodputPolicy(GMAX, lambda: ROOFLINE, calibration_rows=16)
    stats = SpecStats()
    assert policy.choose(StepContext(rows=8, context_len=50, stats=stats)) == GMAX
    assert "calibrating" in policy.decisions[-1].reason
    stats.observe_acceptance(GMAX, torch.tensor([5] * 8 + [4] * 8))       # 16 rows, high acceptance
    assert policy.choose(StepContext(rows=1, context_len=50, stats=stats)) == GMAX
    assert policy.decisions[-1].predicted_goodput                            # a real decision now
    low = SpecStats()
    low.observe_acceptance(GMAX, torch.zeros(200, dtype=torch.long))
    seeded = GoodputPolicy(GMAX, lambda: model(a=1e-3, b=1e-3), prior=low, calibration_rows=16)
    assert seeded.choose(StepContext(rows=32, context_len=50, stats=SpecStats())) == 0   # prior: no calibration


def test_fit_finds_the_multi_token_step_and_trusts_real_steps_over_the_profile():
    truth = CostModel((3e-3, 1e-5, 0.0, 0.0), 1.0, (1e-3, 1e-5, 1e-3, 1e-5), 0, multi_token_s=1.2e-3)
    steps = [StepRecord(g, r, g + 1, 100, truth.verify_s(r, g + 1, 100), truth.draft_s(r, g), 1)
             for r in (1, 4, 16) for g in range(4)]
    fit = fit_cost_model(steps)
    assert fit.verify_s(1, 2, 100) - fit.verify_s(1, 1, 100) == pytest.approx(1.2e-3 + 1e-5, rel=0.05)
    # a profile that says drafting is half as costly as the steps the engine really ran
    profile = [StepRecord(g, r, g + 1, 100, truth.verify_s(r, g + 1, 100), truth.draft_s(r, g) / 2, 0)
               for r in (1, 4, 16) for g in range(1, 4) for _ in range(3)]
    real = [s for s in steps if s.rows == 1 and s.gamma == 2] * 3
    mixed = fit_cost_model(real, profile=profile)
    assert mixed.draft_s(1, 2) == pytest.approx(truth.draft_s(1, 2), rel=0.25)


def test_fit_prices_per_row_work_that_does_not_grow_with_q():
    # each row reads its KV cache once per step and carries a fixed cost, whatever its q: at 48
    # rows one token costs 25 ms and four 65 ms (2.6x, not 4x); speculation is priced by that ratio
    truth = CostModel((3e-3, 2.5e-4, 0.0, 0.0), 1.0, (1e-3, 1e-5, 1e-3, 1e-5), 0, row_coef=(2e-4, 2e-7))
    profile = [StepRecord(g, r, g + 1, ctx, truth.verify_s(r, g + 1, ctx), truth.draft_s(r, g), 0)
               for r in (1, 4, 16, 48) for g in range(6) for ctx in (64, 256)]
    fit = fit_cost_model([], profile=profile)
    for rows, ctx in ((48, 100), (16, 200), (1, 64)):
        for q in (1, 4):
            assert fit.verify_s(rows, q, ctx) == pytest.approx(truth.verify_s(rows, q, ctx), rel=0.02)
    # records at one q cannot tell a row from a token: the per-row terms stay out of the fit
    one_q = fit_cost_model([StepRecord(0, r, 1, 64, truth.verify_s(r, 1, 64), 0.0, 1) for r in (1, 4, 16, 48)])
    assert one_q.row_coef == (0.0, 0.0)
    assert one_q.verify_s(16, 1, 64) == pytest.approx(truth.verify_s(16, 1, 64), rel=0.02)


def test_fit_recovers_the_per_step_overhead_and_the_policy_pays_it_once_per_step():
    truth = CostModel((1e-3, 1e-5, 0.0, 0.0), 1.0, (2e-4, 1e-6, 2e-4, 1e-6), 0, overhead_coef=(2e-3, 5e-5))
    steps = [StepRecord(g, r, g + 1, 50, truth.verify_s(r, g + 1, 50), truth.draft_s(r, g), 1,
                        truth.overhead_s(r)) for r in (1, 4, 16, 32) for g in range(4)]
    fit = fit_cost_model(steps)
    assert fit.overhead_coef == pytest.approx((2e-3, 5e-5), rel=0.05)
    assert fit.step_s(8, 2, 50) == pytest.approx(truth.step_s(8, 2, 50), rel=0.05)
    # the profile's bare forwards carry no overhead: only real steps set it
    assert fit_cost_model([], profile=steps).overhead_coef == (0.0, 0.0)
    # a step's fixed overhead is paid per step, so emitting more tokens per step amortises it:
    # the same forwards and acceptance that do not pay without it do pay with it
    acc = [0.6] * GMAX
    bare = CostModel((1e-3, 1e-5, 0.0, 0.0), 1.0, (3e-4, 1e-6, 3e-4, 1e-6), 0, multi_token_s=4e-4)
    heavy = CostModel(bare.verify_coef, bare.knee, bare.draft_coef, 0, multi_token_s=4e-4, overhead_coef=(3e-3, 0.0))
    assert choose_gamma(bare, acc, rows=1, ctx=50, gamma_max=GMAX).gamma == 0
    assert choose_gamma(heavy, acc, rows=1, ctx=50, gamma_max=GMAX).gamma > 0


def test_policy_reuses_a_decision_only_while_rows_model_and_context_stay():
    prior = SpecStats()
    prior.reached, prior.accepted = [1000] * GMAX, [800] * GMAX
    current = {"model": ROOFLINE}
    policy = GoodputPolicy(GMAX, lambda: current["model"], prior, recheck_steps=8, recheck_plain_steps=32)
    for _ in range(40):
        policy.choose(StepContext(rows=300, context_len=100, stats=SpecStats()))
    assert policy.decisions[0].gamma == 0                       # compute-bound: plain decoding ...
    assert len({id(d) for d in policy.decisions}) == 2          # ... decided at steps 1 and 33
    for _ in range(20):
        g = policy.choose(StepContext(rows=2, context_len=100, stats=SpecStats()))
    assert len({id(d) for d in policy.decisions}) == 5          # fewer rows: decided afresh, at 1, 9, 17
    assert g == choose_gamma(ROOFLINE, estimate_acceptance(prior.reached, prior.accepted, GMAX), 2, 100, GMAX).gamma
    assert g > policy.decisions[0].gamma
    current["model"] = model(b=1e-4, draft=(1e-4, 1e-6, 1e-4, 1e-6))       # a refit: compute-bound
    assert policy.choose(StepContext(rows=2, context_len=100, stats=SpecStats())) == 0


def test_a_plain_decision_stands_without_its_moving_inputs_only_at_its_shape():
    """`plain_stands` reuses the last priced gamma-0 decision before `choose` builds the inputs
    that move from step to step (waiting fills, rows near their budget): at the same rows,
    context bucket and model, within `recheck_plain_steps` counted with the memo's reuses; never
    a speculative decision, and each standing step records the decision."""
    prior = SpecStats()
    prior.reached, prior.accepted = [1000] * GMAX, [800] * GMAX
    current = {"model": ROOFLINE}
    policy = GoodputPolicy(GMAX, lambda: current["model"], prior, recheck_steps=8, recheck_plain_steps=32)
    assert not policy.plain_stands(300, 100)                    # nothing decided yet
    assert policy.choose(StepContext(rows=300, context_len=100, stats=SpecStats())) == 0
    stood = 0
    while policy.plain_stands(300, 100):
        stood += 1
    assert stood == 31 and len(policy.decisions) == 32          # the decision, then 31 reuses: its 32 steps
    assert len({id(d) for d in policy.decisions}) == 1
    assert policy.choose(StepContext(rows=300, context_len=100, stats=SpecStats())) == 0   # decided afresh
    assert len({id(d) for d in policy.decisions}) == 2
    assert policy.plain_stands(300, 127) and not policy.plain_stands(300, 128)   # the context's bucket
    assert not policy.plain_stands(299, 100)                                     # the rows
    current["model"] = model(b=1e-4, draft=(1e-4, 1e-6, 1e-4, 1e-6))            # a refit
    assert not policy.plain_stands(300, 100)
    current["model"] = ROOFLINE
    assert policy.choose(StepContext(rows=2, context_len=100, stats=SpecStats())) > 0
    assert not policy.plain_stands(2, 100)                      # speculation is re-priced by `choose`
    # only a clear plain decision stands: one every speculative gamma loses by more than min_gain
    near = Decision(0, "gamma 1 within the margin", [0, 1, 2], [1000.0, 1030.0, 990.0], [0.6, 0.5])
    clear = Decision(0, "no gamma beats plain decoding", [0, 1, 2], [1000.0, 940.0, 900.0], [0.6, 0.5])
    assert not policy._clearly_plain(near) and policy._clearly_plain(clear)
    policy._decide = lambda ctx, m: policy._record(near)
    assert policy.choose(StepContext(rows=4, context_len=100, stats=SpecStats())) == 0
    assert not policy.plain_stands(4, 100)


def test_policy_keeps_a_decision_per_shape_when_shapes_alternate():
    # rows switching sources make steps with and without a waiting heads' fill alternate: each
    # shape reuses its own decision rather than deciding afresh at every switch
    prior = SpecStats()
    prior.reached, prior.accepted = [1000] * GMAX, [800] * GMAX
    policy = GoodputPolicy(GMAX, lambda: ROOFLINE, prior, recheck_steps=8, recheck_plain_steps=32)
    decided = []
    real = policy._decide
    policy._decide = lambda ctx, m: decided.append(ctx.waiting_fill_s) or real(ctx, m)
    for i in range(20):
        policy.choose(StepContext(rows=2, context_len=100, stats=SpecStats(), waiting_fill_s=1e-3 * (i % 2)))
    assert policy.decisions[0].gamma > 0
    assert decided == [0.0, 1e-3, 0.0, 1e-3]                   # each shape at its steps 1 and 9
    assert len({id(d) for d in policy.decisions}) == 4


def test_real_steps_correct_the_model_locally_and_flip_a_mispriced_choice():
    # the smooth model says plain decoding at one row costs 3 ms; the engine measures 1.5 ms there
    truth = CostModel((1e-3, 1e-5, 0.0, 0.0), 1.0, (2e-4, 1e-6, 2e-4, 1e-6), 0, multi_token_s=2e-4)
    profile = [StepRecord(g, r, g + 1, 50, truth.verify_s(r, g + 1, 50), truth.draft_s(r, g), 0)
               for r in (1, 2, 4, 8, 16, 32) for g in range(4) for _ in range(2)]
    acc = [0.8] * 3
    assert choose_gamma(fit_cost_model([], profile=profile), acc, 1, 50, 3).gamma > 0
    fast_plain = [StepRecord(0, 1, 1, 50, 0.5e-3, 0.0, 1, 1e-3) for _ in range(6)]
    slow_spec = [StepRecord(3, 1, 4, 50, 4e-3, 1e-3, 2, 1e-3) for _ in range(6)]
    fit = fit_cost_model(fast_plain + slow_spec, profile=profile)
    assert fit.step_s(1, 0, 50) == pytest.approx(1.5e-3, rel=1e-6)          # priced as measured
    assert fit.step_s(1, 3, 50) == pytest.approx(6e-3, rel=1e-6)
    assert fit.local_factor(1, 2, 50) == fit.local_factor(1, 3, 50)          # unmeasured gamma: nearest gamma
    assert fit.local_factor(1, 0, 400) == fit.local_factor(1, 0, 50)         # unmeasured context: same gamma
    assert fit.local_factor(16, 0, 50) == 1.0                                # other rows: the model
    assert choose_gamma(fit, acc, 1, 50, 3).gamma == 0
    # fewer than MIN_LOCAL steps correct nothing
    assert fit_cost_model(fast_plain[:3] + slow_spec[:3], profile=profile).local.factors == {}


def test_speculation_must_clear_the_margin_over_plain_decoding():
    acc = [0.8, 0.7, 0.6, 0.5, 0.4]
    free = choose_gamma(ROOFLINE, acc, rows=48, ctx=300, gamma_max=GMAX)
    gain = free.predicted_goodput[free.gamma] / free.predicted_goodput[0]
    assert free.gamma > 0 and gain > 1
    above = choose_gamma(ROOFLINE, acc, rows=48, ctx=300, gamma_max=GMAX, min_gain=(gain - 1) * 0.9)
    assert above.gamma == free.gamma
    within = choose_gamma(ROOFLINE, acc, rows=48, ctx=300, gamma_max=GMAX, min_gain=(gain - 1) * 1.1)
    assert within.gamma == 0 and "margin" in within.reason
    assert within.predicted_goodput == free.predicted_goodput          # the stated goodput is unchanged


def test_plain_decoding_is_measured_at_a_shape_before_speculating_there():
    local = LocalCorrection()
    measured = replace(ROOFLINE, local=local)
    prior = SpecStats()
    prior.reached, prior.accepted = [1000] * GMAX, [800] * GMAX
    policy = GoodputPolicy(GMAX, lambda: measured, prior)
    want = choose_gamma(measured, estimate_acceptance(prior.reached, prior.accepted, GMAX), 2, 100, GMAX, policy.min_gain)
    assert want.gamma > 0
    for i in range(MIN_LOCAL):
        assert policy.choose(StepContext(rows=2, context_len=100, stats=SpecStats())) == 0
        assert policy.decisions[-1].measuring and f"({i}/{MIN_LOCAL} steps)" in policy.decisions[-1].reason
        local.add(StepRecord(0, 2, 1, 100, ROOFLINE.modelled_step_s(2, 0, 100), 0.0, 2), measured)
    assert policy.choose(StepContext(rows=2, context_len=100, stats=SpecStats())) == want.gamma
    # the next context octave (a row decoding on) borrows that fresh price; two octaves on is
    # another shape; a constructed model without local steps never waits
    assert policy.choose(StepContext(rows=2, context_len=150, stats=SpecStats())) == want.gamma
    assert not policy.decisions[-1].measuring
    assert policy.choose(StepContext(rows=2, context_len=400, stats=SpecStats())) == 0
    assert GoodputPolicy(GMAX, lambda: ROOFLINE, prior).choose(StepContext(2, 400, SpecStats())) > 0


def test_without_a_profile_plain_decoding_is_not_measured_first():
    """A call that took no profile (`plain_first` False: its model is fitted from its own real
    steps, gamma 0's among them) speculates at a new shape at once; a plain price it has there
    still ages, and is re-measured once older than the budget allows."""
    local = LocalCorrection()
    measured = replace(ROOFLINE, local=local)
    prior = SpecStats()
    prior.reached, prior.accepted = [1000] * GMAX, [800] * GMAX
    policy = GoodputPolicy(GMAX, lambda: measured, prior, plain_first=False)
    assert policy.choose(StepContext(rows=2, context_len=100, stats=SpecStats())) > 0
    assert not policy.decisions[-1].measuring
    d = policy.decisions[-1]
    due = MIN_LOCAL * (d.predicted_goodput[d.gamma] / d.predicted_goodput[0] - 1) / policy.remeasure_share
    _timed_steps(local, measured, 0, 1e3 * ROOFLINE.modelled_step_s(2, 0, 100), 1, rows=2, ctx=100)
    _timed_steps(local, measured, 3, 1e3 * ROOFLINE.modelled_step_s(2, 3, 400), int(due) + 1, rows=2, ctx=400)
    policy = GoodputPolicy(GMAX, lambda: measured, prior, plain_first=False)
    assert policy.choose(StepContext(rows=2, context_len=100, stats=SpecStats())) == 0
    assert policy.decisions[-1].measuring and "re-measuring plain decoding" in policy.decisions[-1].reason


def test_a_borrowed_plain_price_ages_like_a_measured_one():
    """The next octave borrows gamma 0's price only while it is younger than the re-measure
    schedule allows at the predicted gap; older, plain decoding is measured there first."""
    local = LocalCorrection()
    measured = replace(ROOFLINE, local=local)
    prior = SpecStats()
    prior.reached, prior.accepted = [1000] * GMAX, [800] * GMAX
    policy = GoodputPolicy(GMAX, lambda: measured, prior)
    _timed_steps(local, measured, 0, 1e3 * ROOFLINE.modelled_step_s(2, 0, 100), MIN_LOCAL, rows=2, ctx=100)
    assert policy.choose(StepContext(rows=2, context_len=150, stats=SpecStats())) > 0
    d = policy.decisions[-1]
    due = MIN_LOCAL * (d.predicted_goodput[d.gamma] / d.predicted_goodput[0] - 1) / policy.remeasure_share
    _timed_steps(local, measured, 3, 1e3 * ROOFLINE.modelled_step_s(2, 3, 400), int(due) + 1, rows=2, ctx=400)
    assert local.nearby_age(0, 2, 150) > due
    policy = GoodputPolicy(GMAX, lambda: measured, prior)            # decides afresh
    assert policy.choose(StepContext(rows=2, context_len=150, stats=SpecStats())) == 0
    assert policy.decisions[-1].measuring and "measuring plain decoding at this shape first" in policy.decisions[-1].reason


def test_rows_near_their_token_budget_cap_the_expected_tokens():
    acc = [0.9] * GMAX
    free = choose_gamma(ROOFLINE, acc, rows=4, ctx=100, gamma_max=GMAX)
    assert free.gamma >= 3
    # one token left everywhere: no draft can be used, so speculation only costs
    assert choose_gamma(ROOFLINE, acc, 4, 100, GMAX, rows_apart=((1, 0, 0),) * 4).gamma == 0
    # two tokens left: at most one draft per row is worth anything
    two = choose_gamma(ROOFLINE, acc, 4, 100, GMAX, rows_apart=((2, 0, 0),) * 4)
    assert two.gamma <= 1
    assert two.predicted_goodput[1] == pytest.approx(4 * expected_tokens(acc, 1) / ROOFLINE.step_s(4, 1, 100))
    assert two.predicted_goodput[3] == pytest.approx(4 * expected_tokens(acc, 1) / ROOFLINE.step_s(4, 3, 100))
    # a mix: the capped rows count at their budget, the others in full
    mixed = choose_gamma(ROOFLINE, acc, 4, 100, GMAX, rows_apart=((2, 0, 0), (3, 0, 0)))
    want = (2 * expected_tokens(acc, 4) + expected_tokens(acc, 1) + expected_tokens(acc, 2)) / ROOFLINE.step_s(4, 4, 100)
    assert mixed.predicted_goodput[4] == pytest.approx(want)


def test_a_row_apart_is_priced_with_its_own_first_draft_hit_rate():
    acc = [0.8] * GMAX
    typical = choose_gamma(ROOFLINE, acc, 1, 100, GMAX)
    assert typical.gamma >= 3
    unseen = choose_gamma(ROOFLINE, acc, 1, 100, GMAX, rows_apart=((50, 0, 0),))
    assert unseen.predicted_goodput == typical.predicted_goodput          # nothing drafted: the task's a_k
    agrees = choose_gamma(ROOFLINE, acc, 1, 100, GMAX, rows_apart=((50, 10, 8),))
    assert agrees.predicted_goodput == pytest.approx(typical.predicted_goodput)
    hard = choose_gamma(ROOFLINE, acc, 1, 100, GMAX, rows_apart=((50, 10, 0),))  # never a first draft right
    assert hard.gamma < typical.gamma
    assert row_acceptance(acc, 10, 0)[0] == pytest.approx(ROW_PRIOR * 0.8 / (10 + ROW_PRIOR))


def _timed_steps(local, model, gamma, ms, n, rows=1, ctx=100):
    for _ in range(n):
        local.add(StepRecord(gamma, rows, gamma + 1, ctx, ms * 1e-3, 0.0, rows), model)


def _spell_setup(every_gamma: bool = False):
    """One row, acceptance 0.3: plain decoding at 10 ms beats gamma 1 at 14 ms (1.3 tokens), but
    gamma 0 was last measured in a 1.5x slow spell (15 ms), so speculation looks 1.39x better.
    every_gamma: gammas 2..GMAX priced by steps of their own too, at gamma 1's ratio to the model
    (so no near tie runs to be measured)."""
    local = LocalCorrection()
    measured = replace(ROOFLINE, local=local)
    prior = SpecStats()
    prior.reached, prior.accepted = [10000] * GMAX, [3000] * GMAX
    for g in range(1, GMAX + 1 if every_gamma else 2):
        _timed_steps(local, measured, g, 14.0 * ROOFLINE.modelled_step_s(1, g, 100) / ROOFLINE.modelled_step_s(1, 1, 100), 8)
    _timed_steps(local, measured, 0, 15.0, 8)
    return local, measured, GoodputPolicy(GMAX, lambda: measured, prior)


def test_gamma_0_priced_in_a_slow_spell_is_re_measured_within_its_budget():
    local, measured, policy = _spell_setup(every_gamma=True)
    ctx = StepContext(rows=1, context_len=100, stats=SpecStats())
    first = policy.choose(ctx)
    d = policy.decisions[-1]
    assert first > 0 and not d.measuring
    gap = d.predicted_goodput[first] / d.predicted_goodput[0] - 1
    due = MIN_LOCAL * gap / policy.remeasure_share
    steps, window = 0, 0.0
    while (g := policy.choose(ctx)) > 0:       # speculate, at what gamma `first` really costs
        e = policy.decisions[-1]
        if e.measuring:                        # a rival gamma's re-measure (`_measure_rival`): it
            rival = 1 - e.predicted_goodput[g] / e.predicted_goodput[first]     # holds the budget
            window = max(window, MIN_LOCAL * max(rival, policy.min_gain) / policy.remeasure_share)
        ms = 14.0 * measured.modelled_step_s(1, g, 100) / measured.modelled_step_s(1, 1, 100)
        _timed_steps(local, measured, g, ms, 1)
        steps += 1
        assert steps <= due + window + policy.recheck_steps + 1, "gamma 0 never re-measured"
    assert steps >= due - 1                    # not before its budget allows
    for i in range(MIN_LOCAL):                 # the re-measure runs its MIN_LOCAL steps
        assert policy.decisions[-1].measuring and "re-measuring plain decoding" in policy.decisions[-1].reason
        _timed_steps(local, measured, 0, 10.0, 1)
        g = policy.choose(ctx)
    assert g == 0 and not policy.decisions[-1].measuring          # plain decoding, as measured now
    assert measured.step_s(1, 0, 100) == pytest.approx(10e-3, rel=1e-6)   # the spell's steps gave way


def test_revisited_bucket_keeps_only_a_few_old_steps():
    local = LocalCorrection()
    m = replace(ROOFLINE, local=local)
    _timed_steps(local, m, 0, 15.0, 16)
    _timed_steps(local, m, 1, 14.0, REVISIT_STEPS)          # not long enough away: nothing given way
    _timed_steps(local, m, 0, 10.0, 1)
    assert local.count(0, 1, 100) == 16 and m.step_s(1, 0, 100) == pytest.approx(15e-3)
    _timed_steps(local, m, 1, 14.0, REVISIT_STEPS + 1)
    _timed_steps(local, m, 0, 10.0, 1)
    assert local.count(0, 1, 100) == MIN_LOCAL and local.visit_steps(0, 1, 100) == 1
    _timed_steps(local, m, 0, 10.0, MIN_LOCAL - 1)
    assert m.step_s(1, 0, 100) == pytest.approx(10e-3)       # the new steps are the majority
    assert local.age(0, 1, 100) == 0 and local.age(1, 1, 100) == MIN_LOCAL


def test_at_gamma_0_a_speculative_price_is_re_measured_within_its_budget():
    """A speculative gamma priced in a slow spell would keep the policy at gamma 0 for good: at
    gamma 0 the best speculative gamma is re-measured, MIN_LOCAL steps at a time, no more often
    than the remeasure budget allows at its predicted loss; once measured at its real cost it
    takes over."""
    local, measured, policy = _spell_setup()
    _timed_steps(local, measured, 0, 10.0, 16)                # gamma 0 re-measured: now the choice
    _timed_steps(local, measured, 1, 40.0, 16)                # gamma 1 priced in a slow spell
    ctx = StepContext(rows=1, context_len=100, stats=SpecStats())
    steps = spec = 0
    while steps < 3000:
        g = policy.choose(ctx)
        if g == 0:
            _timed_steps(local, measured, 0, 10.0, 1)
        else:
            spec += 1
            assert policy.decisions[-1].measuring or spec > MIN_LOCAL
            _timed_steps(local, measured, 1, 11.0, 1)         # gamma 1 really costs 11 ms (1.3 tokens)
        steps += 1
        if spec > MIN_LOCAL:
            break
    d = next(d for d in policy.decisions if d.measuring)
    loss = 1 - d.predicted_goodput[1] / d.predicted_goodput[0]
    assert "re-measuring gamma 1" in d.reason and loss > 0
    assert steps >= MIN_LOCAL * loss / policy.remeasure_share - MIN_LOCAL     # not before its budget
    assert spec > MIN_LOCAL and policy.choose(ctx) > 0                       # speculating: at the best gamma,
    d = policy.decisions[-1]                                                  # or at a near tie priced by gamma
    assert not d.measuring or "measuring gamma" in d.reason and "on another gamma's price" in d.reason   # 1's steps

def test_prompt_fills_a_speculative_re_measure_would_run_count_in_its_budget():
    """The first step of a speculative re-measure runs the heads over every waiting prompt, lost
    work if plain decoding stays ahead: fills worth 2 plain steps add 2 / MIN_LOCAL to each of its
    steps' loss, so the re-measure waits that much longer."""
    def first_remeasure(fills_s):
        local, measured, policy = _spell_setup()
        _timed_steps(local, measured, 0, 10.0, 16)
        _timed_steps(local, measured, 1, 40.0, 16)           # gamma 1 priced in a slow spell
        ctx = StepContext(rows=1, context_len=100, stats=SpecStats(), waiting_fill_total_s=fills_s)
        for step in range(20000):
            if policy.choose(ctx):
                return step, policy.decisions[-1]
            _timed_steps(local, measured, 0, 10.0, 1)
    plain, d = first_remeasure(0.0)
    filled, e = first_remeasure(20e-3)
    loss = max(1 - d.predicted_goodput[1] / d.predicted_goodput[0], GoodputPolicy.min_gain)
    assert "re-measuring gamma 1" in d.reason and "re-measuring gamma 1" in e.reason
    assert filled >= MIN_LOCAL * (loss + 2 / MIN_LOCAL) / GoodputPolicy.remeasure_share - MIN_LOCAL
    assert filled - plain >= 2 / GoodputPolicy.remeasure_share - 2 * MIN_LOCAL      # 400 steps later


def test_re_measures_share_one_budget_over_every_bucket():
    """A batch draining through many rows buckets, each priced long ago, re-measures one bucket
    per budget window, not every bucket it passes (before: all 9 here, 36 of 36 steps)."""
    local = LocalCorrection()
    measured = replace(model(a=1e-3, b=5e-3, draft=(1e-3, 1e-5, 1e-3, 1e-5)), local=local)   # compute-bound
    prior = SpecStats()
    prior.reached, prior.accepted = [1000] * GMAX, [500] * GMAX
    sizes = (48, 37, 26, 19, 13, 9, 7, 6, 4)                 # nine rows buckets
    for r in sizes:
        for g in (0, 1):
            _timed_steps(local, measured, g, 1e3 * measured.modelled_step_s(r, g, 100), MIN_LOCAL, rows=r)
    for _ in range(2000):                                    # a long call elsewhere: every price ages
        local.add(StepRecord(0, 1, 1, 100, 1e-3, 0.0, 1), measured)
    policy = GoodputPolicy(GMAX, lambda: measured, prior)
    gammas = []
    for r in sizes:
        for _ in range(MIN_LOCAL):
            g = policy.choose(StepContext(rows=r, context_len=100, stats=SpecStats()))
            gammas.append(g)
            _timed_steps(local, measured, g, 1e3 * measured.modelled_step_s(r, g, 100), 1, rows=r)
    remeasured = [d for d in policy.decisions if d.measuring and "re-measuring gamma 1" in d.reason]
    assert len(remeasured) == MIN_LOCAL                      # one re-measure, all its steps
    assert sum(gammas) == MIN_LOCAL and gammas[:MIN_LOCAL] == [1] * MIN_LOCAL
    loss = 1 - remeasured[0].predicted_goodput[1] / remeasured[0].predicted_goodput[0]
    assert local.next_remeasure >= local.clock - len(gammas) + MIN_LOCAL * loss / policy.remeasure_share


def test_steps_at_a_callers_fixed_gamma_do_not_age_the_policys_prices():
    """Prices age by the policy's own steps: an engine's fixed-gamma calls between two auto
    calls price the buckets they run, but leave the others as fresh as the auto call left them,
    so the next auto call does not re-measure for them (the budget is a share of its steps)."""
    from pipeline.engine.costs import CostTracker
    tracker = CostTracker()
    step = lambda g: StepRecord(g, 1, g + 1, 100, 2e-3, 1e-3 * g, g + 1)     # noqa: E731
    for g in (0, 2):
        for _ in range(MIN_LOCAL):
            tracker.record(step(g), refine=True)
    ages = tracker.local.age(0, 1, 100), tracker.local.age(2, 1, 100)
    for _ in range(500):                       # a caller's gamma-3 call: refine=False
        tracker.record(step(3), refine=False)
    assert (tracker.local.age(0, 1, 100), tracker.local.age(2, 1, 100)) == ages == (MIN_LOCAL, 0)
    assert tracker.local.age(3, 1, 100) == 0 and tracker.local.count(3, 1, 100) > 0
    tracker.record(step(2), refine=True)
    assert tracker.local.age(0, 1, 100) == MIN_LOCAL + 1 and tracker.local.age(3, 1, 100) == 1


def test_waiting_prompt_fills_keep_a_row_with_few_tokens_left_from_starting_to_draft():
    """A speculative step first runs the heads over the prompts still waiting: 50 ms of fills
    spread over 7 tokens left costs each step E(gamma) x 7.1 ms, so no gamma beats plain
    decoding (gamma 5: 3.69 tokens / 37.8 ms against 1 / 10); over 500 tokens it barely counts."""
    acc = [0.8] * GMAX
    free = choose_gamma(ROOFLINE, acc, 1, 100, GMAX)
    assert free.gamma == GMAX
    short = choose_gamma(ROOFLINE, acc, 1, 100, GMAX, waiting_fill_s=50e-3 / 7)
    assert short.gamma == 0 and "waiting prompt fills" in short.reason
    assert choose_gamma(ROOFLINE, acc, 1, 100, GMAX, waiting_fill_s=50e-3 / 500).gamma == GMAX


def test_a_callers_few_steps_at_a_shape_are_no_re_measure_for_the_policy_to_finish():
    """Two gamma-1 steps a fixed-gamma call just ran at this shape look like a re-measure under
    way (fewer than MIN_LOCAL visits, recent); the policy runs gamma 1 only for re-measures it
    started, so with gamma 1 predicted far behind it runs gamma 0 (before: gamma 1, measuring)."""
    local = LocalCorrection()
    measured = replace(model(a=1e-3, b=5e-3, draft=(1e-3, 1e-5, 1e-3, 1e-5)), local=local)   # compute-bound
    prior = SpecStats()
    prior.reached, prior.accepted = [1000] * GMAX, [100] * GMAX
    _timed_steps(local, measured, 0, 1e3 * measured.modelled_step_s(2, 0, 100), MIN_LOCAL, rows=2)
    _timed_steps(local, measured, 1, 1e3 * measured.modelled_step_s(2, 1, 100), 2, rows=2)
    policy = GoodputPolicy(GMAX, lambda: measured, prior)
    assert policy.choose(StepContext(rows=2, context_len=100, stats=SpecStats())) == 0
    assert not policy.decisions[-1].measuring


# plain decoding wins at a_k = 0.6 and gamma 1 at 0.7 (rows=1, ctx 50)
MARGINAL = model(a=10e-3, b=2e-3, draft=(5e-3, 0.0, 5e-3, 0.0))


def _prior(scale: float) -> SpecStats:
    """a_1 = 0.6, a_2 = 0.67 over 20 * scale row-steps at depth 1."""
    return SpecStats([round(20 * scale), round(12 * scale)], [round(12 * scale), round(8 * scale)])


def test_upper_acceptance_is_a_deviation_above_the_mean_that_shrinks_with_evidence():
    mean = estimate_acceptance([20], [15], depth=1)[0]
    assert mean == pytest.approx(17 / 24)
    assert upper_acceptance([20], [15], depth=1)[0] == pytest.approx(mean + (mean * (1 - mean) / 25) ** 0.5)
    gaps = [upper_acceptance([n], [3 * n // 4], 1)[0] - estimate_acceptance([n], [3 * n // 4], 1)[0]
            for n in (20, 200, 2000)]
    assert gaps[0] > gaps[1] > gaps[2] > 0 and gaps[2] < 0.01
    assert upper_acceptance([0], [0], 2, z=10) == [0.99, 0.99]


def test_plain_decoding_by_a_weak_estimate_explores_and_a_strong_one_does_not():
    ctx = StepContext(rows=1, context_len=50, stats=SpecStats())
    weak = GoodputPolicy(GMAX, lambda: MARGINAL, prior=_prior(1), calibrated=True)
    assert weak.choose(ctx) > 0 and "exploring" in weak.decisions[-1].reason
    d = weak.decisions[-1]
    assert d.exploring and d.predicted_goodput[d.gamma] <= d.predicted_goodput[0] * (1 + weak.min_gain)   # the mean: plain
    weak.choose(ctx)
    assert weak.decisions[-1] is not d          # not reused: every exploring step's drafts may end it
    optimistic = choose_gamma(MARGINAL, upper_acceptance(_prior(1).reached, _prior(1).accepted, GMAX), 1, 50, GMAX)
    gp = optimistic.predicted_goodput
    assert d.gamma == min(g for g in range(1, GMAX + 1) if gp[g] > gp[0] * (1 + weak.min_gain))   # the shallowest
    strong = GoodputPolicy(GMAX, lambda: MARGINAL, prior=_prior(50), calibrated=True)
    assert strong.choose(ctx) == 0
    blind = GoodputPolicy(GMAX, lambda: MARGINAL, prior=_prior(1), calibrated=True, optimism=0)
    assert blind.choose(ctx) == 0


def test_depths_the_prior_never_saw_are_explored_one_deeper_until_seen():
    """A prior measured at gamma 3 (as a checkpoint's held-out report may be) says nothing of
    depths 4 and 5: where the mean picks gamma 3 but the optimistic view picks 5, gamma 4 runs;
    once depth 4 has been seen often enough the deviation is gone and the mean decides. Without
    optimism the policy never drafts past the prior's depth."""
    cost = model(a=10e-3, b=0.5e-3, draft=(3e-3, 0.0, 3e-3, 0.0))
    prior = SpecStats([30, 26, 22], [26, 22, 18])                      # depths 1..3, a ~0.85
    ctx = StepContext(rows=1, context_len=50, stats=SpecStats())
    policy = GoodputPolicy(GMAX, lambda: cost, prior=prior, calibrated=True)
    assert policy.choose(ctx) == 4
    d = policy.decisions[-1]
    assert d.exploring and "one depth deeper" in d.reason
    assert d.predicted_goodput[3] == max(d.predicted_goodput)         # the mean's choice is 3
    blind = GoodputPolicy(GMAX, lambda: cost, prior=prior, calibrated=True, optimism=0)
    assert blind.choose(ctx) == 3
    stats, rng = SpecStats(), random.Random(0)                         # depth 4 accepts 0.5 of the time
    for _ in range(300):
        g = policy.choose(StepContext(rows=1, context_len=50, stats=stats))
        if g:
            run = 0
            while run < g and rng.random() < (0.85 if run < 3 else 0.5):
                run += 1
            stats.observe_acceptance(g, torch.tensor([run]))
    deeper = [i for i, d in enumerate(policy.decisions) if "one depth deeper" in d.reason]
    assert 0 < len(deeper) <= 60 and deeper[-1] < 200                 # bounded, and over by itself
    assert policy.decisions[-1].gamma <= 4 and not policy.decisions[-1].exploring


@pytest.mark.parametrize("accept_rate, speculates", [(0.55, False), (0.9, True)])
def test_exploring_ends_by_itself_and_finds_high_acceptance(accept_rate, speculates):
    policy = GoodputPolicy(GMAX, lambda: MARGINAL, prior=_prior(1), calibrated=True)
    stats, rng = SpecStats(), random.Random(0)
    for _ in range(200):
        g = policy.choose(StepContext(rows=1, context_len=50, stats=stats))
        if g:
            run = 0
            while run < g and rng.random() < accept_rate:
                run += 1
            stats.observe_acceptance(g, torch.tensor([run]))
    explored = sum("exploring" in d.reason for d in policy.decisions)
    assert 0 < explored <= 60                                   # bounded: the deviation shrank
    assert not any("exploring" in d.reason for d in policy.decisions[-100:])
    assert (policy.decisions[-1].gamma > 0) == speculates


def test_drafting_measured_at_one_context_is_not_priced_as_context():
    """A fresh call's first drafted steps all sit at its first prompt's context: the fit must
    not read their cost as a slope along context (it had priced a depth at half its cost at
    60 tokens from steps at 150), while steps spread over contexts still fit one."""
    def steps(ctxs):
        out = []
        for ctx in ctxs:
            out += [StepRecord(0, 1, 1, ctx, 2.1e-3, 0.0, 1, 1e-4),
                    StepRecord(1, 1, 2, ctx, 2.9e-3, (0.5e-3 + 0.8e-3) * (1 + ctx / 1000), 2, 1e-4),
                    StepRecord(2, 1, 3, ctx, 2.9e-3, (0.5e-3 + 1.6e-3) * (1 + ctx / 1000), 2, 1e-4)]
        return out
    one = fit_cost_model(steps([150.0]))
    assert one.draft_ctx_s == 0.0
    for g, measured in ((1, 1.3e-3 * 1.15), (2, 2.1e-3 * 1.15)):
        assert one.draft_s(1, g, 60.0) == pytest.approx(measured, rel=0.05)     # the cost at 150, not a slope
    spread = fit_cost_model(steps([40.0, 150.0, 400.0]))
    assert spread.draft_ctx_s > 0
    assert spread.draft_s(1, 2, 400.0) > spread.draft_s(1, 2, 40.0)



def test_a_near_tie_priced_by_another_gammas_steps_is_measured_then_decided_by_its_own():
    """The smooth model prices each token past its knee at 0.4 ms where it takes 0.3: with gamma 0
    and 2 measured it picks gamma 2, and gammas 1, 3 and 4, priced on gamma 2's factor, are
    predicted within `min_gain` of it; gamma 5 is not. Each near tie runs MIN_LOCAL steps marked
    `measuring`; gamma 3 measured cheaper takes over, which brings gamma 5 (priced on gamma 4's
    factor now) within the margin of it, and it is measured too; then the policy settles on the
    truth's best, gamma 3."""
    believed = CostModel((1e-3, 0.0, 0.4e-3, 0.0), 2.0, (0.1e-3, 0.0, 0.05e-3, 0.0), 0)
    truth = replace(believed, verify_coef=(1e-3, 0.0, 0.3e-3, 0.0))
    local = LocalCorrection()
    measured = replace(believed, local=local)
    prior = SpecStats()
    prior.reached, prior.accepted = [10000] * GMAX, [9000] * GMAX
    for g in (0, 2):
        _timed_steps(local, measured, g, 1e3 * truth.modelled_step_s(1, g, 100), MIN_LOCAL)
    policy = GoodputPolicy(GMAX, lambda: measured, prior)
    ctx = StepContext(rows=1, context_len=100, stats=SpecStats())
    ran = []
    for _ in range(48):
        g = policy.choose(ctx)
        ran.append((g, policy.decisions[-1]))
        _timed_steps(local, measured, g, 1e3 * truth.modelled_step_s(1, g, 100), 1)
    gp = ran[0][1].predicted_goodput
    assert max(range(len(gp)), key=gp.__getitem__) == 2                       # the model alone: gamma 2
    assert gp[5] * (1 + policy.min_gain) < gp[2] < min(gp[1], gp[3], gp[4]) * (1 + policy.min_gain)
    measuring = [g for g, d in ran if d.measuring]
    assert all("on another gamma's price" in d.reason for _, d in ran if d.measuring)
    assert sorted(set(measuring)) == [1, 3, 4, 5] and len(measuring) == 4 * MIN_LOCAL
    assert all("behind gamma 3" in d.reason for g, d in ran if g == 5)        # only once gamma 3 leads
    assert all(g == 3 and not d.measuring for g, d in ran[-16:])              # the truth's best
    truth_gp = choose_gamma(truth, [0.9] * GMAX, 1, 100, GMAX).predicted_goodput
    assert max(range(GMAX + 1), key=truth_gp.__getitem__) == 3


@pytest.mark.parametrize("context", [100, 300])
def test_a_speculative_rival_priced_in_a_slow_spell_is_re_measured_within_its_budget(context):
    """Acceptance 0.9 at one row: gamma 1 at 11 ms (172 tokens/s) and gamma 2 at 12 ms (226)
    against plain decoding's 10 ms; gamma 2 was priced in a slow spell (20 ms, 136) at context
    100, so the policy speculates at gamma 1, at that context or the next bucket's (300, where
    gamma 2 takes context 100's price). Only the gamma run is re-priced, so gamma 2 is
    re-measured while speculating, MIN_LOCAL steps, once its steps are older than the budget
    allows at its predicted loss; then it takes over."""
    local = LocalCorrection()
    measured = replace(ROOFLINE, local=local)
    prior = SpecStats()
    prior.reached, prior.accepted = [10000] * 2, [9000] * 2
    truth = {0: 10.0, 1: 11.0, 2: 12.0}
    for g, ms in ((0, 10.0), (1, 11.0), (2, 20.0)):
        _timed_steps(local, measured, g, ms, 8)
        if g < 2:
            _timed_steps(local, measured, g, ms, 8, ctx=context)
    assert context_bucket(context) != context_bucket(100) or context == 100
    policy = GoodputPolicy(2, lambda: measured, prior)
    ctx = StepContext(rows=1, context_len=context, stats=SpecStats())
    ran = []
    for _ in range(400):
        g = policy.choose(ctx)
        ran.append((g, policy.decisions[-1]))
        _timed_steps(local, measured, g, truth[g], 1, ctx=context)
    first = ran[0][1]
    assert first.gamma == 1 and not first.measuring
    loss = 1 - first.predicted_goodput[2] / first.predicted_goodput[1]
    i = next(i for i, (g, d) in enumerate(ran) if d.measuring)
    assert i >= MIN_LOCAL * loss / policy.remeasure_share - policy.recheck_steps    # not before its budget
    assert all(g == 1 for g, d in ran[:i])
    assert all(g == 2 and d.measuring and "re-measuring gamma 2" in d.reason for g, d in ran[i:i + MIN_LOCAL])
    after = [g for g, d in ran[i + MIN_LOCAL:] if not d.measuring]     # (later re-measures: gamma 1's, 0's)
    assert len(after) > 100 and set(after) == {2}                       # then gamma 2
