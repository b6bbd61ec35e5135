"""The driver's plan, from constructed evidence and costs (pure logic: no engine, no Ray)."""
import pytest

from pipeline.spec_decode.cost import CostModel
from pipeline.spec_decode.evidence import PRIOR_ROW_STEPS, UNSEEN, RunEvidence
from pipeline.spec_decode.plan import available_share, busy_model, plan_gamma, scaled_counts
from pipeline.spec_decode.policy import GoodputPolicy, StepContext
from pipeline.spec_decode.stats import SpecStats

GMAX = 5
# memory-bound until 16 tokens per forward, then compute-bound; drafting is cheap
ROOFLINE = CostModel((10e-3, 1e-6, 400e-6, 0.0), 16, (0.2e-3, 1e-6, 0.3e-3, 1e-6), 0)


def counts(acceptance, n=1000):
    """Per-depth counts of `n` row-steps at gamma GMAX with per-depth acceptance a_k."""
    reached, accepted, alive = [], [], float(n)
    for a in acceptance:
        reached.append(round(alive))
        accepted.append(round(alive * a))
        alive *= a
    return reached, accepted


def shard_row(task, acceptance, n=1000):
    reached, accepted = counts(acceptance, n)
    return {"task": task, "reached_by_depth": reached, "accepted_by_depth": accepted}


def test_the_plan_follows_the_evidence_as_acceptance_falls():
    ev = RunEvidence(GMAX)
    ev.observe_actor("a1", ROOFLINE, None, batch=8)
    ev.observe_rows([shard_row("t", [0.9] * GMAX)])
    high = ev.plan(1, "a1", rows=8).for_task("t")
    assert high.gamma >= 2 and high.calibrate and high.prior_row_steps == 1000
    gammas = [high.gamma]
    for _ in range(4):          # later shards accept far less: the evidence pulls the plan down
        ev.observe_rows([shard_row("t", [0.1] * GMAX, n=3000)])
        gammas.append(ev.plan(2, "a1", rows=8).for_task("t").gamma)
    assert gammas == sorted(gammas, reverse=True) and gammas[-1] < gammas[0]


def test_plan_gamma_is_the_goodput_argmax_and_none_without_evidence():
    r, a = counts([0.9] * GMAX)
    assert plan_gamma(ROOFLINE, r, a, rows=1, context_len=100, gamma_max=GMAX)[0] == GMAX
    assert plan_gamma(None, r, a, 1, 100, GMAX)[0] is None
    assert plan_gamma(ROOFLINE, [], [], 1, 100, GMAX)[0] is None
    assert plan_gamma(ROOFLINE, r, a, 1, 100, 0)[0] == 0


def test_a_busy_spell_lowers_the_plan():
    ev = RunEvidence(GMAX)
    ev.observe_rows([shard_row("t", [0.8] * GMAX)])
    ev.observe_actor("gpu", ROOFLINE, 0.30, device="cuda:0", batch=16)     # baseline: 30% busy
    idle = ev.plan(1, "gpu", rows=16).for_task("t")
    ev.observe_actor("gpu", None, 0.90, device="cuda:0", batch=16)         # a co-tenant: 90% busy
    busy = ev.plan(2, "gpu", rows=16).for_task("t")
    assert busy.gamma < idle.gamma and "device busy" in busy.reason
    ev.observe_actor("gpu", None, 0.32, device="cuda:0", batch=16)         # the spell is over
    assert ev.plan(3, "gpu", rows=16).for_task("t").gamma == idle.gamma


def test_busy_model_and_available_share():
    assert available_share(0.9, 0.3, "cuda:0") == pytest.approx(0.4)
    assert available_share(0.2, 0.3, "cuda:0") == 1.0
    assert available_share(0.5, 1.0, "cpu") == pytest.approx(0.5)      # half the CPU time went elsewhere
    assert available_share(None, 0.3, "cpu") == 1.0
    half = busy_model(ROOFLINE, 0.5)
    assert half.knee == ROOFLINE.knee / 2 and half.verify_coef[1] == pytest.approx(2e-6)
    assert half.verify_coef[0] == ROOFLINE.verify_coef[0]                 # fixed per-step cost kept
    assert busy_model(ROOFLINE, 1.0) is ROOFLINE


def test_an_unseen_task_is_calibrated_by_one_shard_at_a_time():
    ev = RunEvidence(GMAX)
    first, second = ev.plan(0, None, 8), ev.plan(1, None, 8)
    assert first.for_task("new").calibrate and not second.for_task("new").calibrate
    assert "shard 0" in second.for_task("new").reason and ev.leases == {UNSEEN: 0}
    ev.observe_rows([shard_row("new", [0.7] * GMAX, n=400)])              # shard 0 commits
    ev.release(0)
    third = ev.plan(2, None, 8).for_task("new")
    assert third.prior_row_steps == 400 and third.source == "this run"     # the merged prior: no calibration needed
    ev.observe_rows([shard_row("short", [0.7] * GMAX, n=10)])             # too little evidence: one shard continues
    assert ev.plan(3, None, 8).for_task("short").calibrate
    assert not ev.plan(4, None, 8).for_task("short").calibrate


def test_a_policy_told_not_to_calibrate_runs_the_plan():
    policy = GoodputPolicy(GMAX, lambda: ROOFLINE, planned=2, calibrate=False)
    assert policy.choose(StepContext(rows=4, context_len=50, stats=SpecStats())) == 2
    assert not policy.decisions[-1].calibrating and "elsewhere" in policy.decisions[-1].reason
    calibrating = GoodputPolicy(GMAX, lambda: ROOFLINE)
    assert calibrating.choose(StepContext(rows=4, context_len=50, stats=SpecStats())) == GMAX
    assert calibrating.decisions[-1].calibrating


def test_a_prior_weighs_at_most_its_cap_and_keeps_its_ratios():
    r, a = scaled_counts([4000, 2000], [2000, 1000], PRIOR_ROW_STEPS)
    assert r[0] == PRIOR_ROW_STEPS and a[0] / r[0] == 0.5 and a[1] / r[1] == 0.5
    ev = RunEvidence(GMAX)
    ev.add_prior({"t": ([4000], [3000]), "*": ([8000], [4000])}, "checkpoint spec_prior.json")
    plan = ev.plan(0, None, 8)
    assert plan.for_task("t").prior_row_steps == PRIOR_ROW_STEPS and not ev.leases    # no calibration needed
    assert plan.for_task("t").source == "checkpoint spec_prior.json"
    assert plan.unseen.prior_row_steps == PRIOR_ROW_STEPS


def test_spread_weight_is_the_beta_size_of_the_tasks_spread():
    """Method of moments on per-task a_1: the docstring's worked example, and its limits."""
    from pipeline.spec_decode.plan import spread_weight
    tasks = {"s": ([402], [218]), "c": ([1343], [776]), "j": ([500], [394])}
    assert spread_weight(tasks, 512) == 28
    assert spread_weight({"s": ([402], [218])}, 512) == 512                     # one task: no spread to read
    assert spread_weight({"a": ([1000], [700]), "b": ([1000], [701])}, 512) == 512   # within count noise
    assert spread_weight({"a": ([10**6], [10**5]), "b": ([10**6], [9 * 10**5])}, 512) == 1
