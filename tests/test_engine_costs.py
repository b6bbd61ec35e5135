"""When the engine's cost knowledge goes stale: drift of measured steps, or a utilisation jump."""
import random
from dataclasses import replace

import pytest

from pipeline.engine import Engine
from pipeline.engine.costs import CostTracker
from pipeline.spec_decode.cost import MIN_LOCAL, CostModel, fit_cost_model
from pipeline.spec_decode.stats import StepRecord
from tests.tiny_models import tiny_checkpoint

TRUTH = CostModel((5e-3, 2e-6, 40e-6, 1e-9), 128, (1e-3, 2e-6, 5e-4, 3e-6), 0)


def records(scale=1.0, seed=0):
    rng = random.Random(seed)
    out = []
    for rows in (1, 4, 16, 64):
        for gamma in range(4):
            for ctx in (64, 256):
                f = scale * (1 + rng.uniform(-0.05, 0.05))
                out.append(StepRecord(gamma, rows, gamma + 1, ctx, TRUTH.verify_s(rows, gamma + 1, ctx) * f,
                                      TRUTH.draft_s(rows, gamma) * f, 0))
    return out


def measured_tracker() -> CostTracker:
    """A tracker whose model was fitted after MIN_LOCAL steps at every shape of `records`."""
    tracker = CostTracker(window=32)
    tracker.set_profile(records())
    for seed in range(1, 1 + MIN_LOCAL):
        for s in records(seed=seed):
            tracker.record(s)
    assert tracker.model() is not None and len(tracker.local.factors) == len(records())
    return tracker


def test_steps_that_match_the_model_keep_it():
    tracker = measured_tracker()
    for s in records(seed=9) * 2:
        tracker.record(s)
    assert len(tracker.ratios) == 32 and tracker.stale_reason is None and not tracker.needs_profile()


def test_drifted_steps_mark_the_model_stale_and_a_new_profile_resets():
    tracker = measured_tracker()
    for s in records(scale=3.0, seed=2) * 2:
        tracker.record(s)
    assert tracker.needs_profile() and "x what was measured" in tracker.stale_reason
    tracker.set_profile(records(scale=3.0))
    assert not tracker.needs_profile() and tracker.profiles_taken == 2 and not tracker.steps
    assert not tracker.local.samples


def test_a_lasting_change_at_one_shape_is_followed_not_drift():
    tracker = measured_tracker()
    slow = [s for s in records(scale=3.0, seed=3) if s.rows == 1 and s.gamma == 0 and s.context_len == 64]
    for _ in range(64):                                  # the correction follows within a few steps
        tracker.record(slow[0])
    assert not tracker.needs_profile()
    s = slow[0]
    assert tracker.model().step_s(s.rows, s.gamma, s.context_len) == pytest.approx(
        s.verify_s + s.draft_s, rel=1e-6)


def test_steps_at_unmeasured_shapes_are_not_drift():
    tracker = CostTracker(window=32)
    tracker.set_profile(records())
    tracker.model()
    for s in records(scale=3.0, seed=2) * 2:            # the smooth model is 3x off, nothing measured before
        tracker.record(s)
    assert not tracker.ratios and not tracker.needs_profile()


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
        model.modelled_step_s(s.rows, s.gamma, s.context_len) * model.local_factor(s.rows, s.gamma, s.context_len))
    for st in steps:                                     # the policy's all-gammas form prices the same
        assert model.step_s_by_gamma(st.rows, 2, st.context_len) == pytest.approx(
            [model.step_s(st.rows, g, st.context_len) for g in range(3)])


def test_a_gammas_price_leaves_out_the_work_any_gamma_pays(tmp_path):
    """Choosing the gamma and releasing finished rows (StepRecord.shared_s) are paid whatever
    the gamma; they fall mostly on plain steps in an auto call (each row's last step, the steps
    measuring plain decoding), so a shape's price leaves them out: two gammas whose steps differ
    only by that work are priced alike. The engine records it, within each step's overhead."""
    from pipeline.engine import SamplingParams
    truth = CostModel((1e-3, 1e-5, 0.0, 0.0), 1.0, (2e-4, 1e-6, 2e-4, 1e-6), 0)
    tracker = CostTracker()
    tracker.set_profile([StepRecord(g, r, g + 1, 100, truth.verify_s(r, g + 1, 100), truth.draft_s(r, g), 0)
                         for r in (1, 4, 16) for g in range(3)])
    model = tracker.model()
    for g, shared in ((0, 0.5e-3), (1, 0.0)):       # gamma 0's steps carry 0.5 ms of release and choice
        for _ in range(MIN_LOCAL):
            v, d = truth.verify_s(1, g + 1, 100), truth.draft_s(1, g)
            tracker.record(StepRecord(g, 1, g + 1, 100, 2 * v, 2 * d, g + 1, shared, shared_s=shared))
    assert model.step_s(1, 0, 100) == pytest.approx(2 * truth.compute_s(1, 0, 100), rel=1e-6)
    assert model.local_factor(1, 0, 100) == pytest.approx(model.local_factor(1, 1, 100), rel=1e-6)
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=2, gamma_max=2)
    engine.generate([[5, 6, 7], [8, 9], [4, 4]], SamplingParams(max_new_tokens=6, ignore_eos=True), gamma="auto")
    steps = engine.last_stats.steps
    assert all(0 < s.shared_s <= s.overhead_s for s in steps)


def test_a_step_is_priced_at_the_context_its_longest_row_attends(tmp_path):
    """A verify attends every row over the longest row's cache (pipeline.model.cache.Batch:
    kv_len is the largest position), so a step's cost sample and its policy price that length,
    not the rows' mean: one 40-token row among 3-token ones costs what 40-token rows do."""
    from pipeline.engine import SamplingParams
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4, gamma_max=2)
    prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13], list(range(20, 60))]
    engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True), gamma=0)
    first = engine.last_stats.steps[0]
    assert first.rows == 4 and first.context_len == 40


def test_profile_times_the_engines_own_drafting(tmp_path, monkeypatch):
    """The profile is all the model knows of drafting until the engine speculates: it must time
    the Drafter the engine runs (every head's fill, then each depth), not a sketch of it."""
    from pipeline.engine.drafter import Drafter
    from pipeline.engine.profile import profile_costs
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=2, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4, gamma_max=3)
    seen, original = [], Drafter.propose

    def propose(self, n, lengths, gamma, pick):
        seen.append((n, gamma))
        return original(self, n, lengths, gamma, pick)

    monkeypatch.setattr(Drafter, "propose", propose)
    records = profile_costs(engine, 4, 3)
    assert {(r.rows, r.gamma) for r in records if r.gamma} <= set(seen)
    assert all(r.draft_s > 0 for r in records if r.gamma) and all(r.draft_s == 0 for r in records if not r.gamma)


def test_local_correction_is_kept_per_context_and_outlives_the_fit_window():
    truth = CostModel((1e-3, 1e-5, 0.0, 1e-8), 1.0, (2e-4, 1e-6, 2e-4, 1e-6), 0, multi_token_s=2e-4)
    profile = [StepRecord(g, r, g + 1, c, truth.verify_s(r, g + 1, c), truth.draft_s(r, g), 0)
               for r in (1, 4, 16) for g in range(3) for c in (50, 400)]
    tracker = CostTracker(fit_steps=8)
    tracker.set_profile(profile)
    tracker.model()
    short = [StepRecord(1, 1, 2, 50, 1e-3, 1e-3, 2, 0.0) for _ in range(MIN_LOCAL)]        # 2 ms at 50 tokens
    long = [StepRecord(1, 1, 2, 400, 4e-3, 2e-3, 2, 0.0) for _ in range(MIN_LOCAL)]       # 6 ms at 400
    for s in short + long:
        tracker.record(s)
    model = tracker.model()
    assert model.step_s(1, 1, 50) == pytest.approx(2e-3, rel=1e-6)
    assert model.step_s(1, 1, 400) == pytest.approx(6e-3, rel=1e-6)
    assert model.local_factor(1, 1, 50) != model.local_factor(1, 1, 400)
    # many steps elsewhere push the one-row steps out of the fit window, not out of the correction
    for _ in range(40):
        tracker.record(StepRecord(0, 16, 1, 50, 2e-3, 0.0, 16, 0.0))
    tracker._new_work_s = float("inf")                                       # make the refit due now
    refit = tracker.model()
    assert refit is not model and refit.step_s(1, 1, 400) == pytest.approx(6e-3, rel=1e-6)


def test_a_waiting_fill_is_priced_at_its_size_not_at_the_mean_per_token():
    """Fills cost a fixed part plus a per-token part (here 0.6 ms + 20 us a token). After
    batch-1 fills of 11-29 tokens, a 48-row fill of 1,000 tokens costs about 20.6 ms; the mean
    per token of those fills prices it at about twice that."""
    tracker = CostTracker()
    for t in (11, 14, 18, 25, 29, 13, 22, 17):
        tracker.note_prompt_fill(0.6e-3 + 2e-5 * t, t)
    mean = sum(s for s, _ in tracker.prompt_fills) / sum(t for _, t in tracker.prompt_fills) * 1000
    assert tracker.prompt_fill_s(1000) == pytest.approx(0.6e-3 + 2e-5 * 1000, rel=0.01)
    assert mean > 1.8 * tracker.prompt_fill_s(1000)
    assert tracker.prompt_fill_s(10) <= sum(s for s, _ in tracker.prompt_fills) / sum(t for _, t in tracker.prompt_fills) * 10
    one_size = CostTracker()
    one_size.note_prompt_fill(2e-3, 50)
    one_size.note_prompt_fill(3e-3, 50)
    assert one_size.prompt_fill_s(100) == pytest.approx(5e-3)        # no line to fit: the mean
    falling = CostTracker()                                         # noise that slopes down: the mean
    falling.note_prompt_fill(3e-3, 10)
    falling.note_prompt_fill(2e-3, 100)
    assert falling.prompt_fill_s(110) == pytest.approx(5e-3)
    assert CostTracker().prompt_fill_s(100) is None


def test_a_refit_is_charged_to_no_steps_sample(tmp_path, monkeypatch):
    """A refit of the cost model falls due between steps and runs before the next one's timing
    starts: it is host work of no step shape. Timed inside the policy's choice it added 15-60 ms
    to one step's sample, and two such samples priced a 48-row gamma 1.26x its cost
    (docs/decisions.md, stop 44). Here each fit moves the clock on by an hour."""
    import time

    import pipeline.engine.costs as costs_module
    from pipeline.engine import SamplingParams
    from pipeline.spec_decode.cost import step_seconds

    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4, gamma_max=2)
    engine.ensure_profile(rows=4)                         # so a fit has shapes to fit: it returns a model
    engine.costs.refit_every, engine.costs.refit_share = 2, 1e9                     # a refit every other step
    hour, offset, real_clock, real_fit = 3600.0, [0.0], time.perf_counter, costs_module.fit_cost_model

    def slow_fit(*args, **kwargs):
        offset[0] += hour
        return real_fit(*args, **kwargs)

    monkeypatch.setattr(costs_module, "fit_cost_model", slow_fit)
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset[0])
    fits = engine.costs.fits
    engine.generate([[5, 6, 7], [8, 9]] * 3, SamplingParams(max_new_tokens=12, ignore_eos=True), gamma="auto")
    assert engine.costs.fits - fits >= 3                  # refits ran during the call ...
    assert all(step_seconds(s) < hour for s in engine.last_stats.steps)   # ... in no step's time


def test_no_fit_is_tried_before_three_verify_shapes(monkeypatch):
    """A fit needs three verify shapes: with fewer measured `model()` answers None without
    fitting (a fixed-gamma call at one row count asked every step, ~0.1 ms of a 2.7 ms step),
    and fits once the third shape is recorded."""
    import pipeline.engine.costs as costs_module
    calls, real_fit = [], costs_module.fit_cost_model
    monkeypatch.setattr(costs_module, "fit_cost_model", lambda *a, **k: calls.append(1) or real_fit(*a, **k))
    tracker = CostTracker()
    shapes = [s for s in records() if s.context_len == 64]
    one, two, three = shapes[1], next(s for s in shapes if s.rows == 4), next(s for s in shapes if s.rows == 16)
    for s in (one, one, two) * 4:
        tracker.record(s)
        assert tracker.model() is None
    assert calls == []
    tracker.record(three)
    assert tracker.model() is not None and calls == [1]
    tracker.set_profile([one])                            # a new profile: the shapes counted anew
    assert tracker.model() is None and calls == [1]


def test_a_fixed_gamma_call_fits_no_cost_model(tmp_path, monkeypatch):
    """A call at a fixed gamma without a profile prices nothing: its steps fit no cost model
    (its drafting asked for one every step, for n-gram tails that only `auto` adds)."""
    import pipeline.engine.costs as costs_module
    from pipeline.engine import SamplingParams
    calls, real_fit = [], costs_module.fit_cost_model
    monkeypatch.setattr(costs_module, "fit_cost_model", lambda *a, **k: calls.append(1) or real_fit(*a, **k))
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=1, gamma_max=3)
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=16, ignore_eos=True), gamma=2, draft="mtp")
    assert len(engine.last_stats.steps) >= 8 and calls == []


@pytest.mark.parametrize("first_s,runs", [(0.001, 8), (0.004, 2), (0.006, 2)])
def test_a_profile_times_a_cheap_shape_more_and_keeps_its_least(monkeypatch, first_s, runs):
    """least_time: after an untimed run, a shape whose first timing fits the budget 8 times is
    timed 8 times (2 at 4 ms and more), and the least timing is kept, whichever it was."""
    import torch

    from pipeline.engine import profile
    now = [0.0]
    monkeypatch.setattr(profile.time, "perf_counter", lambda: now[0])
    costs = iter([first_s, first_s] + [first_s * 1.5] * 3 + [first_s * 0.5] + [first_s * 2] * 10)   # untimed first
    calls = []

    def fn():
        calls.append(1)
        now[0] += next(costs)

    best = profile.least_time(fn, 2, torch.device("cpu"))
    assert len(calls) == 1 + runs
    assert best == pytest.approx(first_s * 0.5 if runs > 5 else first_s)


def test_steps_count_from_a_prefill_of_the_whole_batch_and_the_first_price_no_shape(tmp_path):
    """The first COLD_STEPS steps after every active row was prefilled run on the caches the
    prefill left (35% slower at one row on the CPU, whatever the gamma): they price no bucket,
    or the gamma a row's first steps ran would keep a cold step's price. A row admitted beside
    running ones starts no count (one prompt's prefill next to a large batch's steps)."""
    from pipeline.engine import SamplingParams
    from pipeline.spec_decode.cost import COLD_STEPS
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=1, gamma_max=2)
    engine.generate([[5, 6, 7], [8, 9]], params, gamma=0)
    assert [s.after_prefill for s in engine.last_stats.steps] == [0, 1, 2, 3] * 2   # one row at a time
    engine.max_batch_size = 2                      # a row with a 2-token budget (the context's end) frees
    engine.generate([[7] * 510, [8, 9], [4, 5, 6]], params, gamma=0)   # its slot while another runs:
    steps = engine.last_stats.steps                                      # no new count there
    assert [(s.rows, s.after_prefill) for s in steps] == [(2, 0), (2, 1), (2, 2), (2, 3), (1, 4)]

    tracker = CostTracker()
    tracker.set_profile(records())
    tracker.model()
    slow = [StepRecord(0, 1, 1, 64, 9e-3, 0.0, 1, after_prefill=k) for k in range(COLD_STEPS)]
    for s in slow * MIN_LOCAL:
        tracker.record(s)
    assert not tracker.local.samples and not tracker.verify_local.samples
    assert len(tracker.steps) == COLD_STEPS * MIN_LOCAL      # the fit window keeps them
    tracker.record(replace(slow[0], after_prefill=COLD_STEPS))
    assert tracker.local.count(0, 1, 64) == 1
