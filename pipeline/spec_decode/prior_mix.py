"""The prior of a call whose task the checkpoint's prior does not name: a mixture of the tasks it does.

All tasks pooled make one weak prior (`plan.spread_weight`: tasks far apart weigh little), so a
call's drafts move it, but only at the rate evidence accumulates; on the demo checkpoint, json
prompts that accept 0.85 of first drafts and 0.95 of deeper ones still read 0.74 and 0.80 after
20 drafted steps, and the policy ran gamma 2-3 where gamma 5 was best. Yet a call mostly resembles
one of the tasks the heads were measured on. `PriorMixture` keeps each task's counts as one
component, plus the pooled weak prior for calls that resemble none, and weighs them by how well
each predicted what the call has drafted so far: the Beta-binomial marginal likelihood, per
depth, of the call's (reached, accepted) under the component's counts (Beta(accepted + 1,
reached - accepted + 1)), times a uniform prior over components. The prior it hands the policy
is the components' counts summed by those weights, so once a call reads like json it is json's.

Example: components json (a_1 0.82 over 512 row-steps) and summarize (0.49 over 512); after 10 of
12 first drafts accepted, json's log-likelihood is ahead by 3, so it weighs 0.95.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.spec_decode.stats import SpecStats

Counts = tuple[tuple[float, ...], tuple[float, ...]]     # (reached, accepted) by depth


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def log_evidence(component: Counts, reached, accepted) -> float:
    """log P(call's counts | component): per depth, Beta-binomial with Beta(A + 1, R - A + 1) from
    the component's counts (R, A); a depth it has no counts for is uniform (Beta(1, 1)). The
    binomial coefficients are the same for every component and left out."""
    cr, ca = component
    total = 0.0
    for k, (n, x) in enumerate(zip(reached, accepted)):
        if n <= 0:
            continue
        r, a = (cr[k], ca[k]) if k < len(cr) else (0.0, 0.0)
        alpha, beta = a + 1.0, r - a + 1.0
        total += _log_beta(alpha + x, beta + n - x) - _log_beta(alpha, beta)
    return total


@dataclass(frozen=True)
class PriorMixture:
    """Named components, each the (reached, accepted) counts the prior would be on its own."""
    components: tuple[tuple[str, Counts], ...]

    @property
    def names(self) -> tuple[str, ...]:
        """The tasks the components stand for ("*", all of them pooled, aside)."""
        return tuple(n for n, _ in self.components if n != "*")

    def weights(self, reached, accepted) -> list[float]:
        """Posterior weight of each component given the evidence counts (uniform prior)."""
        logs = [log_evidence(c, reached, accepted) for _, c in self.components]
        top = max(logs)
        w = [math.exp(v - top) for v in logs]
        s = sum(w)
        return [x / s for x in w]

    def prior(self, reached, accepted) -> SpecStats:
        """The components' counts summed by their posterior weights given the evidence."""
        w = self.weights(reached, accepted)
        depth = max(len(c[0]) for _, c in self.components)
        r, a = [0.0] * depth, [0.0] * depth
        for wi, (_, (cr, ca)) in zip(w, self.components):
            for k in range(len(cr)):
                r[k] += wi * cr[k]
                a[k] += wi * ca[k]
        return SpecStats(r, a)

    def leading(self, reached, accepted) -> tuple[str, float]:
        """The component that weighs most given the evidence, and its weight (for reasons and stats)."""
        w = self.weights(reached, accepted)
        i = max(range(len(w)), key=w.__getitem__)
        return self.components[i][0], w[i]
