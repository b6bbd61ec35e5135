"""The report page: one self-contained HTML file (plotly's JavaScript inlined, no network).

Every chart is a <div class="chart"> with its figure as JSON beside it; a small script draws
them with Plotly.newPlot. A window.onerror hook writes JavaScript errors into #js-errors, and
after drawing the page sets <body data-charts-rendered="N">, so a headless browser's DOM dump
shows whether the charts rendered. With `poll_url` (the live server) the page reloads itself
when the run directory changes.
"""
from __future__ import annotations

import html
import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable

import plotly.io as pio

from pipeline.dashboard import figures, timeline
from pipeline.dashboard.load import RunView

CHARTS: list[tuple[str, Callable, str]] = [
    ("throughput", figures.throughput_figure, "no shard has finished yet"),
    ("gamma", figures.gamma_figure, "no shard has a gamma yet"),
    ("plan", figures.plan_figure, "no shard has a plan yet"),
    ("acceptance", figures.acceptance_figure, "no drafts verified yet (gamma 0 or no shards)"),
    ("sources", figures.source_figure, "no drafts verified yet (by any source)"),
    ("cost", timeline.cost_figure, "no verify-step samples yet"),
    ("utilization", timeline.utilization_figure, "no utilisation measured yet"),
    ("commits", timeline.commits_figure, "no shard committed yet"),
]

TITLES = {"gamma-histogram": "Verify steps per gamma", "plan": "Planned vs used gamma per shard", "throughput": "Tokens/s per shard",
          "gamma": "Gamma per shard", "acceptance": "Per-depth acceptance per task",
          "sources": "Draft tokens per source",
          "cost": "Verify cost model", "utilization": "Utilisation over time",
          "commits": "Shards committed per actor over time"}

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px}
.meta{color:#555;font-size:13px;margin-bottom:12px}
.status{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-size:13px}
.s-finished{background:#2ca02c}.s-running{background:#1f77b4}.s-failed,.s-interrupted{background:#d62728}
.s-unknown{background:#7f7f7f}
.tiles{display:flex;flex-wrap:wrap;gap:10px}
.tile{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px 14px;min-width:130px}
.tile .v{font-size:22px;font-weight:600}.tile .k{font-size:12px;color:#666}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:14px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:6px;min-height:120px}
.card h3{font-size:14px;font-weight:600;margin:6px 8px}
.note{color:#777;font-style:italic;padding:16px}
table{border-collapse:collapse;background:#fff;font-size:13px}
td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f0f0f0} #js-errors{color:#d62728}
"""

BOOT = """
(function(){
  var drawn = 0;
  document.querySelectorAll('div.chart').forEach(function(div){
    var spec = JSON.parse(document.getElementById(div.id + '-data').textContent);
    Plotly.newPlot(div, spec.data, spec.layout, {responsive: true, displaylogo: false});
    drawn += 1;
  });
  document.body.setAttribute('data-charts-rendered', String(drawn));
})();
"""

ERROR_HOOK = """
window.addEventListener('error', function(e){
  var ul = document.getElementById('js-errors');
  var li = document.createElement('li');
  li.className = 'js-error';
  li.textContent = 'JavaScript error: ' + (e.message || e.type) + ' at ' + (e.filename || '') + ':' + (e.lineno || '');
  if (ul) ul.appendChild(li);
  document.documentElement.setAttribute('data-js-errors', 'yes');
});
"""

POLL = """
(function(){
  var seen = null;
  setInterval(function(){
    fetch(%(url)s, {cache: 'no-store'}).then(function(r){ return r.text(); }).then(function(v){
      if (seen === null) { seen = v; } else if (v !== seen) { location.reload(); }
    }).catch(function(){});
  }, %(ms)d);
})();
"""


@lru_cache(maxsize=1)
def plotly_js() -> str:
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def _script_json(obj: Any) -> str:
    return obj.replace("</", "<\\/") if isinstance(obj, str) else json.dumps(obj).replace("</", "<\\/")


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def wall_time_s(view: RunView) -> float | None:
    """From the manifest's started_at to its last update; else the stats rows' time span."""
    m = view.manifest
    try:
        start = datetime.strptime(m["started_at"], "%Y-%m-%dT%H:%M:%S%z")
        end = datetime.strptime(m["updated_at"], "%Y-%m-%dT%H:%M:%S%z")
        return (end - start).total_seconds()
    except (KeyError, TypeError, ValueError):
        pass
    ends = [r["finished_at"] for r in view.rows if r.get("finished_at") is not None]
    start = timeline.run_start(view.rows)
    return max(ends) - start if ends and start is not None else None


def tiles(view: RunView) -> str:
    t = view.totals
    planned = (view.manifest.get("plan") or {}).get("rows")
    rows = t.get("rows", sum(int(r.get("num_rows") or 0) for r in view.rows))
    items = [
        ("rows", f"{fmt(rows)}" + (f" / {fmt(planned)}" if planned is not None else "")),
        ("rows with errors", fmt(t.get("rows_with_error", 0))),
        ("generated tokens", fmt(t.get("generated_tokens"))),
        ("tokens/s", fmt(t.get("tokens_per_s"))),
        ("wall time (s)", fmt(wall_time_s(view))),
        ("mean acceptance length", fmt(t.get("mean_acceptance_length"), 2)),
        ("shards", f"{len({r.get('shard_id') for r in view.rows})} / "
                   f"{fmt((view.manifest.get('plan') or {}).get('num_shards'))}"),
    ]
    return "".join(f'<div class="tile"><div class="v">{html.escape(v)}</div>'
                   f'<div class="k">{html.escape(k)}</div></div>' for k, v in items)


def problem_shards(view: RunView) -> list[dict]:
    """Shards with errors, retries, or a failed/pending status in the manifest."""
    entries = {e.get("shard_id"): e for e in view.shard_entries}
    out = []
    for r in view.rows:
        e = entries.get(r.get("shard_id"), {})
        attempts = max(int(r.get("attempt") or 0), int(e.get("attempts") or 0))
        if (r.get("num_errors") or 0) > 0 or attempts > 1:
            out.append({"shard": r.get("shard_id"), "task": r.get("task"), "status": e.get("status", "committed"),
                        "rows": r.get("num_rows"), "errors": r.get("num_errors"), "attempts": attempts,
                        "note": r.get("gamma_reason")})
    seen = {o["shard"] for o in out}
    for sid, e in entries.items():
        if sid not in seen and (e.get("status") == "failed" or int(e.get("attempts") or 0) > 1):
            out.append({"shard": sid, "task": "-", "status": e.get("status"), "rows": e.get("num_rows"),
                        "errors": "-", "attempts": e.get("attempts"), "note": "-"})
    return sorted(out, key=lambda o: (o["shard"] is None, o["shard"] or 0))


def errors_table(view: RunView) -> str:
    rows = problem_shards(view)
    if not rows:
        return '<p class="note" id="no-problem-shards">No shard had errors or needed a retry.</p>'
    cols = ["shard", "task", "status", "rows", "errors", "attempts", "note"]
    head = "".join(f"<th>{c}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(r[c]))}</td>" for c in cols) + "</tr>"
                   for r in rows)
    return f'<table id="problem-shards"><tr>{head}</tr>{body}</table>'


def chart_cards(view: RunView) -> str:
    hist = figures.gamma_histogram(view.rows, view.totals.get("gamma_histogram"))
    cards = []
    for name, make, empty in [("gamma-histogram", lambda rows: hist, "no steps decoded yet")] + CHARTS:
        try:
            fig = make(view.rows)
        except Exception as exc:       # one bad chart must not hide the others
            fig, empty = None, f"could not draw: {exc}"
        if fig is None:
            cards.append(f'<div class="card"><h3>{html.escape(TITLES[name])}</h3>'
                         f'<p class="note" id="empty-{name}">{html.escape(empty)}</p></div>')
        else:
            title = (fig.layout.meta or {}).get("title", TITLES[name])
            cards.append(f'<div class="card"><h3>{html.escape(title)}</h3><div class="chart" id="chart-{name}"></div>'
                         f'<script type="application/json" id="chart-{name}-data">'
                         f'{_script_json(pio.to_json(fig, validate=False))}</script></div>')
    return "".join(cards)


def render(view: RunView, poll_url: str | None = None, poll_ms: int = 3000) -> str:
    """The whole page as a string."""
    cfg = view.manifest.get("config") or {}
    spec = cfg.get("spec") or {}
    meta = " · ".join(html.escape(str(x)) for x in (
        f"model {(cfg.get('model') or {}).get('path', '-')}", f"data {(cfg.get('data') or {}).get('path', '-')}",
        f"spec.gamma={spec.get('gamma', '-')} (max {spec.get('gamma_max', '-')})",
        f"started {view.manifest.get('started_at', '-')}", f"updated {view.manifest.get('updated_at', '-')}"))
    problems = "".join(f"<li>{html.escape(p)}</li>" for p in view.problems)
    live = ""
    if poll_url and view.status not in ("finished", "failed"):
        live = f"<script>{POLL % {'url': json.dumps(poll_url), 'ms': poll_ms}}</script>"
    status = html.escape(view.status)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>specbatch run {html.escape(str(view.run_dir).rstrip("/").rsplit("/", 1)[-1])}</title>
<style>{CSS}</style>
<script>{ERROR_HOOK}</script>
<script>{plotly_js()}</script>
</head><body>
<h1>Run {html.escape(str(view.run_dir))} <span class="status s-{status}">{status}</span></h1>
<div class="meta">{meta}</div>
<ul id="js-errors"></ul>
<ul class="problems">{problems}</ul>
<h2>Totals</h2><div class="tiles" id="totals">{tiles(view)}</div>
<h2>Speculation</h2><div class="grid">{chart_cards(view)}</div>
<h2>Shards with errors or retries</h2>{errors_table(view)}
<script>{BOOT}</script>{live}
</body></html>
"""
