"""A call that names no task starts from the checkpoint's tasks as a mixture, weighed by its drafts."""
import pytest

from pipeline.spec_decode.policy import GoodputPolicy, StepContext, estimate_acceptance
from pipeline.spec_decode.prior_mix import PriorMixture, log_evidence
from pipeline.spec_decode.stats import SpecStats

EASY = ((512.0, 460.0), (460.0, 414.0))        # a_1 0.90, a_2 0.90
HARD = ((512.0, 128.0), (128.0, 38.0))         # a_1 0.25, a_2 0.30
POOLED = ((5.0, 2.93), (2.93, 2.21))           # both pooled, weak (tasks far apart)
MIX = PriorMixture((("easy", EASY), ("hard", HARD), ("*", POOLED)))


def test_without_evidence_every_component_weighs_the_same():
    assert MIX.weights([], []) == pytest.approx([1 / 3] * 3)
    assert MIX.names == ("easy", "hard")


def test_a_call_that_drafts_like_one_task_takes_that_tasks_counts():
    reached, accepted = [12, 10], [10, 9]      # 10 of 12 first drafts, 9 of 10 second ones
    w = MIX.weights(reached, accepted)
    assert w[0] > 0.85 and w[0] > 5 * w[2] and w[1] < 1e-6
    prior = MIX.prior(reached, accepted)
    assert prior.reached[0] == pytest.approx(512, rel=0.15)
    assert prior.accepted[0] / prior.reached[0] == pytest.approx(0.9, abs=0.01)
    assert MIX.leading(reached, accepted)[0] == "easy"
    # the same evidence over the pooled prior alone still reads well below the call's own 0.83
    pooled = estimate_acceptance([POOLED[0][0] + 12], [POOLED[1][0] + 10], 1)[0]
    mixed = estimate_acceptance([prior.reached[0] + 12], [prior.accepted[0] + 10], 1)[0]
    assert mixed > 0.88 and pooled < 0.8


def test_a_call_unlike_every_task_leans_on_the_weak_pooled_component():
    reached, accepted = [100, 60], [60, 36]    # a_1 0.6: neither 0.9 nor 0.25
    name, weight = MIX.leading(reached, accepted)
    assert name == "*" and weight > 0.99
    assert MIX.prior(reached, accepted).reached[0] < 6      # so the call's own counts decide


def test_a_depth_a_component_never_measured_counts_as_uniform():
    short = ((512.0,), (460.0,))
    assert log_evidence(short, [10, 8], [9, 4]) == pytest.approx(log_evidence(short, [10], [9])
                                                                 + log_evidence(((1e-12,), (0.0,)), [8], [4]), abs=1e-6)


def test_the_policy_prices_with_the_mixture_as_its_prior():
    """A GoodputPolicy holding the mixture (and no counts of its own) estimates a_1 from the
    component the call's drafts point to."""
    policy = GoodputPolicy(2, lambda: None, SpecStats(), calibrated=True, mixture=MIX)
    policy.choose(StepContext(rows=1, context_len=16.0, stats=SpecStats([12, 10], [10, 9])))
    assert policy.decisions[-1].acceptance[0] == pytest.approx(0.9, abs=0.01)
    policy = GoodputPolicy(2, lambda: None, SpecStats(), calibrated=True, mixture=MIX)
    policy.choose(StepContext(rows=1, context_len=16.0, stats=SpecStats([12, 3], [3, 1])))
    assert policy.decisions[-1].acceptance[0] == pytest.approx(0.25, abs=0.01)
