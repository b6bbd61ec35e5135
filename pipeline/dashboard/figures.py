"""The speculation charts: gamma histogram, tokens/s against predicted gamma-0 tokens/s,
gamma per shard by task (reason on hover), per-depth acceptance per task, draft tokens per
source.

Each function takes the stats rows (one per shard x task) and returns a plotly Figure, or None
when there is nothing to draw yet; the page shows a note instead.
"""
from __future__ import annotations

import textwrap
from collections import defaultdict
from typing import Any, Sequence

import plotly.graph_objects as go

Rows = Sequence[dict[str, Any]]
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")


def styled(fig: go.Figure, title: str, x: str, y: str, height: int = 340) -> go.Figure:
    """The house layout. The title is kept in layout.meta and shown by the page above the chart
    (plotly's own title would sit under the mode bar)."""
    fig.update_layout(meta={"title": title}, template="plotly_white", height=height, showlegend=True,
                      margin=dict(l=60, r=20, t=40, b=50),
                      legend=dict(orientation="h", x=0, y=1.02, xanchor="left", yanchor="bottom"),
                      hoverlabel=dict(align="left"))
    fig.update_xaxes(title_text=x)
    fig.update_yaxes(title_text=y)
    return fig


def task_colors(rows: Rows) -> dict[str, str]:
    tasks = sorted({str(r.get("task")) for r in rows})
    return {t: PALETTE[i % len(PALETTE)] for i, t in enumerate(tasks)}


def shard_label(row: dict) -> str:
    return f"{row.get('shard_id')}/{row.get('task')}"


def wrap(text: Any, width: int = 70) -> str:
    return "<br>".join(textwrap.wrap(str(text or ""), width)) or "-"


def gamma_histogram(rows: Rows, histogram: dict | None = None) -> go.Figure | None:
    """Verify steps run at each gamma (the manifest's histogram; else summed from the rows'
    `gamma_steps`). A shard with no steps (failed) shows under "none (failed)" with 0."""
    if not histogram:
        histogram = defaultdict(int)
        for r in rows:
            steps = r.get("gamma_steps") or []
            for g, n in enumerate(steps):
                histogram[str(g)] += int(n or 0)
            if not any(steps) and r.get("gamma") is None:
                histogram["None"] += 0
    if not histogram:
        return None
    keys = sorted(histogram, key=lambda g: (not g.lstrip("-").isdigit(), int(g) if g.lstrip("-").isdigit() else 0, g))
    labels = ["none (failed)" if k == "None" else k for k in keys]
    fig = go.Figure(go.Bar(x=labels, y=[histogram[k] for k in keys], marker_color="#1f77b4",
                           hovertemplate="gamma %{x}: %{y} steps<extra></extra>"))
    fig.update_xaxes(type="category")
    return styled(fig, "Verify steps per gamma", "gamma", "steps", height=300).update_layout(showlegend=False)


def plan_figure(rows: Rows) -> go.Figure | None:
    """Per shard: the driver's planned gamma next to the gamma used on most steps, and the
    steps spent calibrating."""
    done = [r for r in rows if r.get("planned_gamma") is not None or r.get("calibration_steps")]
    if not done:
        return None
    x = [shard_label(r) for r in done]
    fig = go.Figure()
    fig.add_trace(go.Scatter(name="planned gamma", x=x, y=[r.get("planned_gamma") for r in done], mode="markers",
                             marker=dict(symbol="circle-open", size=10),
                             customdata=[[r.get("prior_source"), r.get("prior_row_steps")] for r in done],
                             hovertemplate="shard %{x}: planned %{y}<br>prior: %{customdata[0]} "
                                           "(%{customdata[1]} row-steps)<extra></extra>"))
    fig.add_trace(go.Scatter(name="gamma used", x=x, y=[r.get("gamma") for r in done], mode="markers",
                             marker=dict(size=6)))
    fig.add_trace(go.Bar(name="calibration steps", x=x, y=[r.get("calibration_steps") or 0 for r in done],
                         yaxis="y2", opacity=0.3))
    fig.update_layout(yaxis2=dict(overlaying="y", side="right", title="calibration steps"))
    return styled(fig, "Planned vs used gamma per shard", "shard", "gamma", height=300)


def throughput_figure(rows: Rows) -> go.Figure | None:
    """Measured tokens/s per shard next to the cost model's predicted gamma-0 tokens/s."""
    done = [r for r in rows if r.get("tokens_per_s") is not None]
    if not done:
        return None
    x = [shard_label(r) for r in done]
    fig = go.Figure()
    fig.add_trace(go.Bar(name="measured tokens/s", x=x, y=[r["tokens_per_s"] for r in done],
                         marker_color="#1f77b4",
                         customdata=[[r.get("gamma"), r.get("task")] for r in done],
                         hovertemplate="shard %{x}<br>%{y:.1f} tokens/s at gamma %{customdata[0]}"
                                       "<extra></extra>"))
    predicted = [r.get("predicted_goodput_gamma0") for r in done]
    if any(p is not None for p in predicted):
        gain = [f"{(m / p - 1) * 100:+.0f}%" if p else "-"
                for m, p in zip((r["tokens_per_s"] for r in done), predicted)]
        fig.add_trace(go.Bar(name="predicted at gamma 0", x=x, y=predicted, marker_color="#aec7e8",
                             customdata=gain,
                             hovertemplate="shard %{x}<br>%{y:.1f} tokens/s predicted without "
                                           "speculation<br>speculation: %{customdata}<extra></extra>"))
    fig.update_layout(barmode="group")
    fig.update_xaxes(type="category")
    return styled(fig, "Tokens/s per shard: measured vs predicted without speculation",
                  "shard/task", "tokens/s")


def gamma_figure(rows: Rows) -> go.Figure | None:
    """Gamma chosen per shard, one colour per task, the policy's reason on hover."""
    done = [r for r in rows if r.get("gamma") is not None]
    if not done:
        return None
    colors = task_colors(rows)
    fig = go.Figure()
    for i, (task, color) in enumerate(colors.items()):
        mine = [r for r in done if str(r.get("task")) == task]
        if not mine:
            continue
        nudge = (i - (len(colors) - 1) / 2) * 0.12        # tasks of one shard side by side
        fig.add_trace(go.Scatter(
            name=task, x=[r["shard_id"] + nudge for r in mine], y=[r["gamma"] for r in mine],
            mode="markers",
            marker=dict(size=12, color=color, line=dict(width=1, color="#333")),
            customdata=[wrap(r.get("gamma_reason")) for r in mine],
            hovertemplate=f"task {task}, shard %{{x:.0f}}: gamma %{{y}}<br>%{{customdata}}<extra></extra>"))
    shard_ids = [r["shard_id"] for r in done]
    fig.update_yaxes(dtick=1, rangemode="tozero")
    fig.update_xaxes(dtick=1, range=[min(shard_ids) - 0.5, max(shard_ids) + 0.5])
    return styled(fig, "Gamma per shard (hover: why)", "shard", "gamma")


def pooled_acceptance(rows: Rows) -> dict[str, list[float | None]]:
    """task -> a_k per depth, averaged over that task's shards weighted by generated tokens."""
    sums: dict[str, list[list[float]]] = defaultdict(list)
    for r in rows:
        acc = r.get("acceptance_by_depth") or []
        weight = float(r.get("num_generated_tokens") or 1)
        cells = sums[str(r.get("task"))]
        while len(cells) < len(acc):
            cells.append([0.0, 0.0])
        for k, a in enumerate(acc):
            if a is not None:
                cells[k][0] += a * weight
                cells[k][1] += weight
    return {t: [s / w if w else None for s, w in cells] for t, cells in sums.items() if cells}


def acceptance_figure(rows: Rows) -> go.Figure | None:
    pooled = pooled_acceptance(rows)
    if not any(any(a is not None for a in acc) for acc in pooled.values()):
        return None
    colors = task_colors(rows)
    fig = go.Figure()
    for task, acc in sorted(pooled.items()):
        fig.add_trace(go.Scatter(
            name=task, x=list(range(1, len(acc) + 1)), y=acc, mode="lines+markers",
            line=dict(color=colors.get(task)),
            hovertemplate=f"task {task}: a_%{{x}} = %{{y:.3f}}<extra></extra>"))
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(range=[0, 1.05])
    return styled(fig, "Per-depth acceptance a_k per task (P(draft k accepted | 1..k-1 accepted))",
                  "depth k", "a_k")


def source_counts(row: dict, key: str) -> dict[str, int]:
    """A stats row's per-source map (Parquet reads a map back as (key, value) pairs)."""
    value = row.get(key) or {}
    return {str(k): int(v or 0) for k, v in (value.items() if isinstance(value, dict) else value)}


def source_figure(rows: Rows) -> go.Figure | None:
    """Draft tokens verified and accepted per source (mtp, ngram) per shard, acceptance on hover."""
    done = [r for r in rows if source_counts(r, "drafted_by_source")]
    if not done:
        return None
    sources = sorted({s for r in done for s in source_counts(r, "drafted_by_source")})
    x = [shard_label(r) for r in done]
    fig = go.Figure()
    for i, source in enumerate(sources):
        drafted = [source_counts(r, "drafted_by_source").get(source, 0) for r in done]
        accepted = [source_counts(r, "accepted_by_source").get(source, 0) for r in done]
        rate = [f"{a / d:.0%}" if d else "-" for a, d in zip(accepted, drafted)]
        color = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Bar(name=f"{source} drafted", x=x, y=drafted, marker_color=color, opacity=0.45,
                             offsetgroup=source, hovertemplate=f"shard %{{x}}: {source} drafted %{{y}}<extra></extra>"))
        fig.add_trace(go.Bar(name=f"{source} accepted", x=x, y=accepted, marker_color=color, offsetgroup=source,
                             customdata=rate, base=0,
                             hovertemplate=f"shard %{{x}}: {source} accepted %{{y}} (%{{customdata}})<extra></extra>"))
    fig.update_layout(barmode="group")
    fig.update_xaxes(type="category")
    return styled(fig, "Draft tokens per source per shard: drafted and accepted", "shard/task", "draft tokens")
