"""The cost and time charts: the fitted verify-cost model against its measured samples,
utilisation over time, and shard commits per actor over time.

Times are seconds since the first task group started (stats rows' started_at/finished_at, unix
seconds). The cost fit is `pipeline.spec_decode.cost.fit_cost_model` over every shard's samples, the
same fit the gamma policy uses, drawn at the samples' median context length and tokens per row.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import plotly.graph_objects as go

from pipeline.dashboard.figures import PALETTE, Rows, styled


def short_actor(actor_id: Any) -> str:
    """A Ray actor id's leading hex digits (its trailing ones are the job id, shared by all)."""
    return "gave up (no actor)" if not actor_id else f"actor {str(actor_id)[:8]}"


def run_start(rows: Rows) -> float | None:
    times = [r.get("started_at") or r.get("finished_at") for r in rows]
    times = [t for t in times if t is not None]
    return min(times) if times else None


def samples_by_device(rows: Rows) -> dict[str, list[SimpleNamespace]]:
    """device -> StepRecord-like samples from the rows' cost_samples."""
    out: dict[str, list[SimpleNamespace]] = defaultdict(list)
    for r in rows:
        for s in r.get("cost_samples") or []:
            if s and len(s) >= 5 and s[3] is not None:
                rows_, q, ctx, verify_s, draft_s = s[:5]
                out[str(r.get("device") or "?")].append(SimpleNamespace(
                    rows=int(rows_), query_len=int(q), gamma=int(q) - 1, context_len=float(ctx or 0),
                    verify_s=float(verify_s), draft_s=float(draft_s or 0)))
    return out


def verify_line_ms(model: Any, grid: list[int], q: int, ctx: float) -> list[float]:
    """The model's own verify time (ms) at N = rows x q tokens for each N of `grid`, q tokens
    per row: at q > 1 it includes the multi-token term, as the policy prices a verify."""
    return [model.verify_s(n / q, q, ctx) * 1e3 for n in grid]


def _model_line(fig: go.Figure, name: str, model: Any, ctx: float, top: int, q: int, color: str,
                dash: str) -> None:
    grid = sorted({1 + round(j * (top - 1) / 60) for j in range(61)} | {int(model.knee)})
    a, b, h, c = model.verify_coef
    m = model.multi_token_s if q > 1 else 0.0
    r, s = model.row_coef
    fig.add_trace(go.Scatter(
        name=name, x=grid, y=verify_line_ms(model, grid, q, ctx), mode="lines",
        line=dict(color=color, width=2, dash=dash),
        hovertemplate=(f"{(a + m) * 1e3:.3g} ms + {b * 1e3:.3g} ms·N + {h * 1e3:.3g} ms·max(0, N-{model.knee:g})"
                       f" + {c * 1e3:.3g} ms·N·ctx + {r * 1e3:.3g} ms·rows + {s * 1e3:.3g} ms·rows·ctx"
                       f"<br>N=%{{x}}: %{{y:.2f}} ms<extra></extra>")))


def policy_model(rows: Rows, device: str) -> Any:
    """The cost model the device's latest shard ran with (its stats row's cost_model)."""
    from pipeline.spec_decode.cost import CostModel

    mine = [r for r in rows if str(r.get("device") or "?") == device and r.get("cost_model")]
    if not mine:
        return None
    return CostModel.from_dict(json.loads(max(mine, key=lambda r: r.get("finished_at") or 0)["cost_model"]))


def cost_figure(rows: Rows) -> go.Figure | None:
    """Measured verify time against rows x tokens, with the model the policy used (dashed) and
    a fit over the samples drawn here (solid, where they hold 3 shapes or more)."""
    from pipeline.spec_decode.cost import fit_cost_model      # torch: imported only when drawing

    by_device = samples_by_device(rows)
    if not by_device:
        return None
    fig = go.Figure()
    for i, (device, samples) in enumerate(sorted(by_device.items())):
        color = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Scatter(
            name=f"measured ({device})", x=[s.rows * s.query_len for s in samples],
            y=[s.verify_s * 1e3 for s in samples], mode="markers",
            marker=dict(color=color, size=7, opacity=0.6),
            customdata=[[s.rows, s.query_len, s.context_len] for s in samples],
            hovertemplate="%{customdata[0]} rows x %{customdata[1]} tokens, ctx %{customdata[2]}"
                          "<br>verify %{y:.2f} ms<extra></extra>"))
        ctx = statistics.median(s.context_len for s in samples)
        q = round(statistics.median(s.query_len for s in samples))     # tokens per row drawn
        top = max(s.rows * s.query_len for s in samples)
        used = policy_model(rows, device)
        if used is not None:
            _model_line(fig, f"policy's model ({device}) at ctx {ctx:.0f}, {q} tokens/row", used, ctx, top, q,
                        color, "dash")
        fitted = fit_cost_model(samples)
        if fitted is not None:
            _model_line(fig, f"fit over these samples ({device})", fitted, ctx, top, q, color, "solid")
    times = [s.verify_s for ss in by_device.values() for s in ss if s.verify_s > 0]
    if times and max(times) > 20 * min(times):     # spans orders of magnitude, as the fit assumes
        fig.update_yaxes(type="log", dtick=1)       # ticks at powers of ten only
    return styled(fig, "Verify cost model: measured verify time vs rows x tokens, with the fit",
                  "N = rows x tokens per row (gamma + 1)", "verify time (ms)")


def utilization_figure(rows: Rows) -> go.Figure | None:
    t0 = run_start(rows)
    done = [r for r in rows if r.get("utilization") is not None and r.get("finished_at") is not None]
    if t0 is None or not done:
        return None
    fig = go.Figure()
    by_actor: dict[str, list[dict]] = defaultdict(list)
    for r in sorted(done, key=lambda r: r["finished_at"]):
        by_actor[short_actor(r.get("actor_id"))].append(r)
    for i, (actor, mine) in enumerate(sorted(by_actor.items())):
        fig.add_trace(go.Scatter(
            name=f"{actor} ({mine[0].get('device')})",
            x=[r["finished_at"] - t0 for r in mine], y=[r["utilization"] * 100 for r in mine],
            mode="lines+markers", line=dict(color=PALETTE[i % len(PALETTE)]),
            customdata=[f"{r.get('shard_id')}/{r.get('task')}" for r in mine],
            hovertemplate="shard %{customdata} ended at %{x:.1f} s: %{y:.0f}% busy<extra></extra>"))
    fig.update_yaxes(range=[0, 105])
    return styled(fig, "Utilisation over time (accelerator, or CPU share on CPU)",
                  "seconds since the run started", "utilisation (%)")


def shard_commits(rows: Rows) -> list[dict]:
    """One entry per shard: its actor, when its last task group finished, rows, errors."""
    shards: dict[Any, dict] = {}
    for r in rows:
        s = shards.setdefault(r.get("shard_id"), {"shard_id": r.get("shard_id"), "actor_id": r.get("actor_id"),
                                                  "finished_at": None, "num_rows": 0, "num_errors": 0})
        s["num_rows"] += int(r.get("num_rows") or 0)
        s["num_errors"] += int(r.get("num_errors") or 0)
        if r.get("finished_at") is not None:
            s["finished_at"] = max(s["finished_at"] or 0.0, r["finished_at"])
    return sorted((s for s in shards.values() if s["finished_at"] is not None),
                  key=lambda s: s["finished_at"])


def commits_figure(rows: Rows) -> go.Figure | None:
    t0 = run_start(rows)
    commits = shard_commits(rows)
    if t0 is None or not commits:
        return None
    by_actor: dict[str, list[dict]] = defaultdict(list)
    for s in commits:
        by_actor[short_actor(s["actor_id"])].append(s)
    fig = go.Figure()
    for i, (actor, mine) in enumerate(sorted(by_actor.items())):
        fig.add_trace(go.Scatter(
            name=actor, x=[s["finished_at"] - t0 for s in mine], y=list(range(1, len(mine) + 1)),
            mode="lines+markers", line=dict(shape="hv", color=PALETTE[i % len(PALETTE)]),
            customdata=[[s["shard_id"], s["num_rows"], s["num_errors"]] for s in mine],
            hovertemplate="shard %{customdata[0]} (%{customdata[1]} rows, %{customdata[2]} errors)"
                          "<br>done at %{x:.1f} s<extra></extra>"))
    fig.update_yaxes(rangemode="tozero", dtick=1 if len(commits) <= 20 else None)
    return styled(fig, "Shards committed per actor over time", "seconds since the run started",
                  "shards done")
