"""Ray metrics for a run: acceptance, gamma and tokens/s, exported through `ray.util.metrics`
so the Ray dashboard and Prometheus (and infra/grafana/specbatch.json) see them on a cluster.

Ray prefixes application metrics with `ray_` and exports a Counter as `<name>_total`, so
`specbatch_tokens_per_s` is scraped as `ray_specbatch_tokens_per_s` and the counter
`specbatch_generated_tokens` as `ray_specbatch_generated_tokens_total`.

`metric_points(stats_rows, totals)` is the pure part (tested directly); `RunMetrics` is a thin
holder of the Gauge/Counter objects that the driver feeds as each shard commits. Exporting is
best effort: a failure is reported once and never fails the run.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

# name -> (kind, description, tag keys besides "run")
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "specbatch_tokens_per_s": ("gauge", "Generated tokens/s of the last committed shard, per task", ("task",)),
    "specbatch_predicted_gamma0_tokens_per_s": (
        "gauge", "Cost model's tokens/s for the last shard without speculation, per task", ("task",)),
    "specbatch_run_tokens_per_s": ("gauge", "Generated tokens/s of the run so far", ()),
    "specbatch_gamma": ("gauge", "Gamma in use on the last committed shard, per task", ("task",)),
    "specbatch_mean_acceptance_length": (
        "gauge", "Tokens emitted per verify step per row on the last shard (bonus included)", ("task",)),
    "specbatch_acceptance_by_depth": (
        "gauge", "a_k = P(draft k accepted | drafts 1..k-1 accepted) on the last shard", ("task", "depth")),
    "specbatch_utilization": ("gauge", "Accelerator (or CPU) utilisation over the last shard, 0..1", ("task",)),
    "specbatch_generated_tokens": ("counter", "Generated tokens", ("task",)),
    "specbatch_rows": ("counter", "Rows committed", ("task",)),
    "specbatch_row_errors": ("counter", "Rows committed with an error", ("task",)),
    "specbatch_shards": ("counter", "Shards committed, by outcome", ("status",)),
}

Point = tuple[str, float, dict[str, str]]


def metric_points(stats_rows: Sequence[dict], totals: dict | None = None) -> list[Point]:
    """(metric name, value, tags) for one committed shard's stats rows and the run totals.
    Gauges with no measured value (None/NaN) are left out; counters of 0 too."""
    points: list[Point] = []

    def add(name: str, value: Any, **tags: Any) -> None:
        if value is None or value != value:
            return
        if METRICS[name][0] == "counter" and value <= 0:
            return
        points.append((name, float(value), {k: str(v) for k, v in tags.items()}))

    failed = False
    for r in stats_rows:
        task = str(r.get("task"))
        add("specbatch_tokens_per_s", r.get("tokens_per_s"), task=task)
        add("specbatch_predicted_gamma0_tokens_per_s", r.get("predicted_goodput_gamma0"), task=task)
        add("specbatch_gamma", r.get("gamma"), task=task)
        add("specbatch_mean_acceptance_length", r.get("mean_acceptance_length"), task=task)
        for k, a in enumerate(r.get("acceptance_by_depth") or [], start=1):
            add("specbatch_acceptance_by_depth", a, task=task, depth=k)
        add("specbatch_utilization", r.get("utilization"), task=task)
        add("specbatch_generated_tokens", r.get("num_generated_tokens") or 0, task=task)
        add("specbatch_rows", r.get("num_rows") or 0, task=task)
        add("specbatch_row_errors", r.get("num_errors") or 0, task=task)
        failed = failed or str(r.get("gamma_reason") or "").startswith("failed")
    if stats_rows:
        add("specbatch_shards", 1, status="failed" if failed else "committed")
    add("specbatch_run_tokens_per_s", (totals or {}).get("tokens_per_s"))
    return points


def _ray_factory(kind: str, name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
    from ray.util import metrics

    cls = metrics.Gauge if kind == "gauge" else metrics.Counter
    return cls(name, description=description, tag_keys=tag_keys)


class RunMetrics:
    """The run's Gauge/Counter objects, tagged with `run` (the run directory's name).
    `factory(kind, name, description, tag_keys)` makes one metric (default: ray.util.metrics)."""

    def __init__(self, run: str, factory: Callable[..., Any] = _ray_factory):
        self.run, self.factory = run, factory
        self.metrics: dict[str, Any] = {}
        self.broken = False

    def _metric(self, name: str) -> Any:
        if name not in self.metrics:
            kind, description, tags = METRICS[name]
            self.metrics[name] = self.factory(kind, name, description, ("run",) + tags)
        return self.metrics[name]

    def observe(self, stats_rows: Sequence[dict], totals: dict | None = None) -> None:
        """Export one committed shard; never raises."""
        if self.broken:
            return
        try:
            for name, value, tags in metric_points(stats_rows, totals):
                metric, tags = self._metric(name), {"run": self.run, **tags}
                if METRICS[name][0] == "gauge":
                    metric.set(value, tags=tags)
                else:
                    metric.inc(value, tags=tags)
        except Exception as exc:
            self.broken = True
            print(f"warning: Ray metrics export stopped: {exc}", file=sys.stderr)
