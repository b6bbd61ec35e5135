"""The plan the driver sends with a shard: per task, the gamma it expects best on that actor and
the prior evidence the actor's policy starts from.

The driver owns the run's evidence (`pipeline.spec_decode.evidence`); this module holds the
plan itself and the math that makes it:

- `plan_gamma`: the goodput argmax (`policy.choose_gamma`) over the actor's cost model and the
  task's per-depth acceptance, at the batch the shard will mostly run (its rows, capped by the
  actor's batch size) and a typical context;
- `busy_model`: the cost model as it is on a device another tenant is using. An accelerator
  that is busy has less idle compute for speculation to fill: each extra verify token costs
  more and the batch size at which a forward turns compute-bound comes sooner. With `available`
  the share of the device this actor gets (1 = all of it), the per-token terms are divided by
  it and the knee multiplied by it; fixed per-step terms are kept. So a busy spell lowers the
  plan's gamma, never raises it.

An actor's per-step policy (`policy.GoodputPolicy`) refines within the plan: it starts from the
plan's prior (no calibration when that is enough evidence), runs the plan's gamma while it has
nothing better (a task calibrated on another actor), and then decides every step from its own
measured costs as the batch drains.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipeline.spec_decode.cost import CostModel
from pipeline.spec_decode.policy import choose_gamma, estimate_acceptance
from pipeline.spec_decode.stats import SpecStats


@dataclass(frozen=True)
class TaskPlan:
    """The plan for one task of a shard."""
    gamma: int | None                       # planned gamma (None: nothing to plan from yet)
    reached: tuple[int, ...] = ()           # prior evidence: row-steps reaching depth k (k = 1..)
    accepted: tuple[int, ...] = ()          # ... and accepting it
    calibrate: bool = True                  # may calibrate at gamma_max while evidence is short
    source: str = "none"                    # where the prior came from
    reason: str = ""

    @property
    def prior_row_steps(self) -> int:
        return self.reached[0] if self.reached else 0

    def prior(self) -> SpecStats:
        return SpecStats(list(self.reached), list(self.accepted))


@dataclass(frozen=True)
class ShardPlan:
    """What the driver sends with a shard. `unseen` is the plan for a task it has no evidence
    of (the shard's tasks are only known once its rows are read)."""
    tasks: dict[str, TaskPlan] = field(default_factory=dict)
    unseen: TaskPlan = TaskPlan(None)
    gamma_max: int = 5

    def for_task(self, name: str) -> TaskPlan:
        return self.tasks.get(name, self.unseen)


def busy_model(model: CostModel, available: float) -> CostModel:
    """`model` on a device of which this actor gets the share `available` (module docstring).
    Example: available 0.5 doubles the cost per verify token and halves the knee."""
    s = min(max(available, 0.05), 1.0)
    if s >= 1.0:
        return model
    a, b, h, c = model.verify_coef
    d, e, f, g = model.draft_coef
    r, rs = model.row_coef
    return replace(model, verify_coef=(a, b / s, h / s, c / s), knee=model.knee * s, row_coef=(r / s, rs / s),
                   draft_coef=(d, e / s, f, g / s), draft_ctx_s=model.draft_ctx_s / s, local=None,
                   verify_local=None)


def available_share(utilization: float | None, baseline: float | None, device: str) -> float:
    """The share of the device this actor gets now, from utilisation measured over its last
    shard against the utilisation when its cost model was measured (`baseline`).
    GPU (NVML: the device's busy share, whoever runs): what rose beyond the baseline is another
    tenant's, so available = 1 - rise. CPU (this process's share of its threads' time): a drop
    below the baseline is time the OS gave to others, so available = share / baseline."""
    if utilization is None or baseline is None:
        return 1.0
    if str(device).startswith("cuda"):
        return min(1.0, max(0.05, 1.0 - max(0.0, utilization - baseline)))
    return min(1.0, max(0.05, utilization / baseline)) if baseline > 0 else 1.0


def plan_gamma(model: CostModel | None, reached, accepted, rows: int, context_len: float,
               gamma_max: int, min_gain: float = 0.05) -> tuple[int | None, str]:
    """The gamma with the highest predicted goodput for `rows` rows at `context_len`, from the
    evidence counts (Beta-smoothed a_k, as the policy does); None without a model or evidence."""
    if gamma_max <= 0:
        return 0, "gamma_max is 0"
    if model is None or not reached or not reached[0]:
        return None, "no cost model or no acceptance evidence yet"
    acc = estimate_acceptance(list(reached), list(accepted), gamma_max)
    d = choose_gamma(model, acc, max(rows, 1), context_len, gamma_max, min_gain)
    return d.gamma, f"plan: {d.reason}"


def scaled_counts(reached, accepted, most: int, whole: bool = True) -> tuple[tuple, tuple]:
    """Counts shrunk so that depth 1 holds at most `most` row-steps (ratios kept): a prior from
    a file or an earlier run counts as `most` row-steps, so this run's evidence soon outweighs it.
    `whole=False` keeps fractional counts, so a prior of a few row-steps keeps its ratios exactly."""
    if not reached or reached[0] <= most:
        return tuple(reached), tuple(accepted)
    f = most / reached[0]
    size = round if whole else float
    return tuple(size(r * f) for r in reached), tuple(size(a * f) for a in accepted)


def spread_weight(tasks: dict, most: int) -> int:
    """How many row-steps the pooled acceptance of several tasks is worth as the prior of a task
    none of them is: the effective size n of a Beta prior with their depth-1 mean m and their
    spread v between tasks (method of moments: n = m (1 - m) / v - 1, v less the binomial
    noise of the counts), at most `most`; `most` with fewer than two tasks (no spread to read).
    Tasks that differ widely make a weak prior, so a call's own drafts soon outweigh it.
    Example: a_1 of 0.54, 0.58 and 0.79 over 402, 1343 and 500 row-steps: m 0.62, v 0.0081,
    n = 28, where the counts alone would weigh 2,245."""
    rows = [(r[0], a[0]) for r, a in tasks.values() if r and r[0] > 0]
    total = sum(r for r, _ in rows)
    if len(rows) < 2 or total <= 0:
        return most
    m = sum(a for _, a in rows) / total
    spread = sum(r * (a / r - m) ** 2 for r, a in rows) / total
    noise = m * (1 - m) * len(rows) / total          # the mean binomial variance of a task's a_1
    v = spread - noise
    if v <= 0:
        return most
    return max(1, min(most, round(m * (1 - m) / v - 1)))
