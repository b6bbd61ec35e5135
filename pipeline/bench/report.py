"""bench.md (tables of ratios, the machine, the targets), bench.json and bench_plots.html."""
from __future__ import annotations

import json
from itertools import groupby
from pathlib import Path


def _group_key(c: dict) -> tuple:
    return (c["task"], c["temperature"], c["prompt_length"])


def break_even_batch(cells: list[dict]) -> int | None:
    """Smallest batch at which the best fixed gamma is 0 (speculation stops paying)."""
    for c in sorted(cells, key=lambda c: c["batch"]):
        fixed = {k: v["tokens_per_s"] for k, v in c["systems"].items() if k.startswith("gamma=") and v["tokens_per_s"]}
        if fixed and max(fixed, key=fixed.get) == "gamma=0":
            return c["batch"]
    return None


def check_targets(cells: list[dict]) -> list[tuple[str, bool, str]]:
    """(target, met, evidence) for the targets the issue sets."""
    out = []
    worst_auto, worst_auto0, worst_g0 = (9.0, ""), (9.0, ""), (9.0, "")
    for c in cells:
        s = {k: v["tokens_per_s"] for k, v in c["systems"].items()}
        if not all(v and v == v for v in s.values()):     # a system decoded nothing (all rows hit EOS at once)
            continue
        where = f"{c['task']} T={c['temperature']} {c['prompt_length']} batch {c['batch']}"
        fixed = [v for k, v in s.items() if k.startswith("gamma=")]
        if "auto" in s and fixed:
            worst_auto = min(worst_auto, (s["auto"] / max(fixed), where))
            worst_auto0 = min(worst_auto0, (s["auto"] / s["gamma=0"], where))
        if "transformers" in s and "gamma=0" in s:
            worst_g0 = min(worst_g0, (s["gamma=0"] / s["transformers"], where))
    if worst_auto[1]:
        out.append(("auto >= 0.95 x best fixed gamma in every cell", worst_auto[0] >= 0.95,
                    f"worst {worst_auto[0]:.2f} ({worst_auto[1]})"))
        out.append(("auto never below gamma 0", worst_auto0[0] >= 1.0, f"worst {worst_auto0[0]:.2f} ({worst_auto0[1]})"))
    if worst_g0[1]:
        out.append(("gamma 0 >= transformers generate() at every batch size", worst_g0[0] >= 1.0,
                    f"worst {worst_g0[0]:.2f} ({worst_g0[1]})"))
    for task in ("complete", "json"):
        at1 = [c for c in cells if c["task"] == task and c["batch"] == 1 and "auto" in c["systems"]
               and c["systems"].get("transformers", {}).get("tokens_per_s")]
        if at1:
            r = min(c["systems"]["auto"]["tokens_per_s"] / c["systems"]["transformers"]["tokens_per_s"] for c in at1)
            out.append((f"auto >= 1.8 x transformers at batch 1 on {task}", r >= 1.8, f"worst {r:.2f}"))
    return out + draft_targets(cells)


def draft_targets(cells: list[dict]) -> list[tuple[str, bool, str]]:
    """The draft-source targets: per-row sources (`draft=auto`) against the heads alone (`auto`),
    gamma 0 and the better single source (`auto` or `draft=ngram`)."""
    out, worst = [], (9.0, "")
    for c in cells:
        s = {k: v["tokens_per_s"] for k, v in c["systems"].items()}
        if "draft=auto" not in s:
            continue
        where = f"{c['task']} T={c['temperature']} {c['prompt_length']} batch {c['batch']}"
        single = [s[k] for k in ("auto", "draft=ngram") if s.get(k)]
        if single:
            worst = min(worst, (s["draft=auto"] / max(single), where))
        if c["task"] == "json" and c["batch"] == 1 and s.get("auto"):
            r = s["draft=auto"] / s["auto"]
            out.append(("json batch 1: draft=auto >= 1.25 x auto (heads only)", r >= 1.25, f"{r:.2f} ({where})"))
        if c["task"] == "json" and c["batch"] >= 32 and s.get("gamma=0"):
            r = s["draft=auto"] / s["gamma=0"]
            out.append((f"json batch {c['batch']}: draft=auto >= 1.2 x gamma 0", r >= 1.2, f"{r:.2f} ({where})"))
    if worst[1]:
        out.append(("draft=auto >= 0.97 x the better single source in every cell", worst[0] >= 0.97,
                    f"worst {worst[0]:.2f} ({worst[1]})"))
    return out


def source_lines(cells: list[dict]) -> list[str]:
    """Per cell and drafting system: tokens per step, draft tokens (accepted) per source, and
    the share of decode time spent drafting (heads, n-gram lookup, per-row choice)."""
    lines = ["", "## Draft sources", "", "| cell | system | tokens/s | tokens per step | drafted (accepted) by source "
             "| drafting share of decode |", "|---|---|---|---|---|---|"]
    for c in cells:
        for name, v in c["systems"].items():
            if not v.get("drafted_by_source") and not name.startswith("draft="):
                continue
            src = ", ".join(f"{k} {n} ({v['accepted_by_source'].get(k, 0)})" for k, n in sorted(v["drafted_by_source"].items()))
            lines.append(f"| {c['task']} b={c['batch']} ({c.get('rows', c['batch'])} rows) | {name} | "
                         f"{_fmt(v['tokens_per_s'])} | {_fmt(v['mean_acceptance_length'], '.2f')} | {src or '-'} | "
                         f"{_fmt(100 * v['draft_share'] if v.get('draft_share') is not None else None, '.1f')}% |")
    return lines if len(lines) > 5 else []


def paired_lines(cells: list[dict]) -> list[str]:
    """Per cell, each policy system over gamma 0 and over the best fixed gamma, repetition by
    repetition: median (min-max) over repetitions (pipeline.bench.runner.paired_ratios)."""
    from pipeline.bench.repeat import show_paired

    lines = ["", "## Paired ratios", "", "Each repetition's tokens/s over the other system's in the same repetition: "
             "median (min-max) over repetitions. The tables above divide medians.", "",
             "| cell | system | over gamma 0 | over the best fixed gamma |", "|---|---|---|---|"]
    for c in cells:
        for name, against in c.get("paired", {}).items():
            best = [k for k in against if k != "gamma=0"]
            g0 = show_paired(against["gamma=0"]) if "gamma=0" in against else "-"
            bf = (f"{show_paired(against[best[0]])} ({best[0]})" if best
                  else f"{g0} (gamma=0)" if "gamma=0" in against else "-")
            lines.append(f"| {c['task']} T={c['temperature']} {c['prompt_length']} b={c['batch']} | {name} | {g0} | {bf} |")
    return lines if len(lines) > 6 else []


def _fmt(x, spec=".0f"):
    return "-" if x is None else format(x, spec)


def write_markdown(result: dict, path: Path, machine: dict) -> str:
    cells = result["cells"]
    lines = ["# Benchmark", "", f"Machine: {machine['device']}; measured matmul {machine['flops'] / 1e9:.1f} GFLOP/s "
             f"({machine['dtype']}), memory bandwidth {machine['bandwidth'] / 1e9:.1f} GB/s. Model: {machine['model']} "
             f"({machine['params'] / 1e6:.1f}M parameters). {machine['max_new_tokens']} new tokens per row, "
             f"median of {machine['reps']} interleaved repetitions. Decode only: prefill is excluded from tokens/s "
             "and reported apart. Cells: decode tokens/s (x transformers generate(), x engine gamma 0).",
             "prompt_lookup is transformers' prompt-lookup decoding, which runs at batch 1 only.", ""]
    lines += ["## Targets", "", "| target | met | evidence |", "|---|---|---|"]
    lines += [f"| {t} | {'yes' if ok else '**no**'} | {ev} |" for t, ok, ev in check_targets(cells)]
    for key, group in groupby(sorted(cells, key=_group_key), key=_group_key):
        group = sorted(group, key=lambda c: c["batch"])
        task, temp, length = key
        batches = [c["batch"] for c in group]
        names = list(dict.fromkeys(n for c in group for n in c["systems"]))
        be = break_even_batch(group)
        lines += ["", f"## {task}, temperature {temp}, {length} prompts (~{group[0]['prompt_tokens']:.0f} tokens)", "",
                  f"Break-even batch (best fixed gamma becomes 0): {be if be else f'none up to {batches[-1]}'}.", "",
                  "| system | " + " | ".join(f"batch {b}" for b in batches) + " | P50 / P95 ms per token (batch 1) |",
                  "|---|" + "---|" * (len(batches) + 1)]
        for name in names:
            row = []
            for c in group:
                s = c["systems"].get(name)
                if s is None:
                    row.append("-")
                    continue
                hf = c["systems"].get("transformers", {}).get("tokens_per_s")
                g0 = c["systems"].get("gamma=0", {}).get("tokens_per_s")
                ratios = [f"{s['tokens_per_s'] / hf:.2f}x" if hf else "-", f"{s['tokens_per_s'] / g0:.2f}x" if g0 else "-"]
                row.append(f"{s['tokens_per_s']:.0f} ({', '.join(ratios)})")
            first = group[0]["systems"].get(name, {})
            lat = f"{_fmt(first.get('p50_token_latency_ms'), '.1f')} / {_fmt(first.get('p95_token_latency_ms'), '.1f')}"
            lines.append(f"| {name} | " + " | ".join(row) + f" | {lat} |")
        roof = [f"batch {c['batch']}: gamma 0 {_fmt(_pct(c, 'gamma=0'))}%, auto {_fmt(_pct(c, 'auto'))}%" for c in group]
        lines += ["", "Achieved fraction of the roofline (ideal decode time at the measured ceilings / actual): "
                  + "; ".join(roof) + "."]
        prefill = [f"batch {c['batch']}: {1000 * c['systems'].get('gamma=0', {}).get('prefill_s', 0):.0f} ms" for c in group]
        lines += ["", "Engine prefill time (excluded above): " + "; ".join(prefill) + "."]
    lines += source_lines(cells) + paired_lines(cells)
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def _pct(cell: dict, name: str):
    frac = cell["systems"].get(name, {}).get("roofline_fraction")
    return None if frac is None else 100 * frac


def write_plots(result: dict, path: Path) -> None:
    """tokens/s against batch size per system, one panel per (task, temperature, prompt length)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    groups = [(k, sorted(g, key=lambda c: c["batch"])) for k, g in
              groupby(sorted(result["cells"], key=_group_key), key=_group_key)]
    fig = make_subplots(rows=len(groups), cols=1, subplot_titles=[f"{t}, T={temp}, {ln} prompts" for (t, temp, ln), _ in groups])
    for i, (_, group) in enumerate(groups, start=1):
        names = list(dict.fromkeys(n for c in group for n in c["systems"]))
        for name in names:
            pts = [(c["batch"], c["systems"][name]["tokens_per_s"]) for c in group if name in c["systems"]]
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=name,
                                     legendgroup=name, showlegend=i == 1), row=i, col=1)
        fig.update_xaxes(type="log", title_text="batch size", row=i, col=1)
        fig.update_yaxes(title_text="decode tokens/s", row=i, col=1)
    fig.update_layout(height=380 * len(groups), title="Decode tokens/s against batch size")
    fig.write_html(str(path), include_plotlyjs=True, full_html=True)


def write_all(result: dict, out_dir: Path, machine: dict, plots: bool = True) -> str:
    """bench.json, bench_plots.html (unless `plots` is False: it needs plotly) and bench.md;
    returns bench.md's text."""
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = {"machine": machine, "cells": result["cells"]}
    (out_dir / "bench.json").write_text(json.dumps(raw, indent=2))          # first: the measurements
    raw["targets"] = check_targets(result["cells"])
    (out_dir / "bench.json").write_text(json.dumps(raw, indent=2))
    if plots:
        write_plots(result, out_dir / "bench_plots.html")
    return write_markdown(result, out_dir / "bench.md", machine)
