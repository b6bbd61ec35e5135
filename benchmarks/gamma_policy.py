"""gamma=auto against every fixed gamma, per demo task, at a small and a large batch.

    python benchmarks/gamma_policy.py                          # demo model and dataset
    python benchmarks/gamma_policy.py --batches 1 48 --reps 7 --new 64 --threads 1

For each task and batch size B, the same prompts (max(2B, --min-prompts) rows of that task, so
continuous batching keeps about B rows active, and a batch-1 call lasts long enough, about a
second here, to time) are generated greedily, EOS respected, by the engine at
each fixed gamma and at `auto`. `auto` runs as a steady-state shard does: with the acceptance
prior of earlier (warm-up) runs of the same task, repeated until the policy's calibration is
done (short-answer tasks need several: summarize at batch 1 gives ~100 row-steps per run). Runs are interleaved round-robin over
--reps repetitions, in reverse order every other repetition (so a slow drift of the machine's
speed does not favour the systems run first), and the median is taken; ratios are within this
one run. Two ratios are given: of the medians, and paired (auto's time in each repetition
against the best fixed gamma's in the same repetition: median, and range over repetitions),
which cancels the repetition-to-repetition swings of a shared machine. A control runs gamma 0
twice in each repetition, next to auto: its paired ratio to gamma 0 is what two identical
systems measure apart here, the noise floor against which auto / gamma 0 is read; it runs next
to auto in the order, so auto / control compares two neighbours (gamma 0 itself runs first or
last in its cell). Prints a
Markdown table and writes JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import torch

from pipeline.demo.tasks import TEMPLATES      # the demo tasks' prompt formats
from pipeline.engine import Engine, SamplingParams
from pipeline.spec_decode.stats import SpecStats

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "pipeline" / "assets" / "demo" / "model"
CONTROL = "gamma=0 again"        # gamma 0 run twice per repetition: the machine's noise floor
DEMO_DATA = ROOT / "pipeline" / "assets" / "demo" / "data" / "demo.parquet"


def task_prompts(path: Path, task: str, n: int) -> list[str]:
    table = pq.read_table(path, columns=["task", "text"]).to_pylist()
    rows = [r["text"] for r in table if r["task"] == task][:n]
    return [TEMPLATES[task].format(text=t) for t in rows]


def timed(engine: Engine, prompts, params, gamma) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, gamma=gamma)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def paired(a: list[float], b: list[float]) -> dict:
    """a / b within each repetition: the median and the range over repetitions."""
    ratios = [x / y for x, y in zip(a, b)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def show(r: dict) -> str:
    return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEMO_MODEL)
    ap.add_argument("--data", type=Path, default=DEMO_DATA)
    ap.add_argument("--tasks", nargs="+", default=list(TEMPLATES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 48])
    ap.add_argument("--gamma-max", type=int, default=5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--min-prompts", type=int, default=24)
    ap.add_argument("--max-warmups", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gamma_policy.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, device=args.device, max_batch_size=max(args.batches),
                                    gamma_max=args.gamma_max)
    params = SamplingParams(max_new_tokens=args.new, temperature=0.0)
    engine.ensure_profile()
    fixed = list(range(args.gamma_max + 1))
    systems = fixed + [CONTROL, "auto"]     # CONTROL: gamma 0 a second time, the noise floor
    cells = {}
    for task in args.tasks:
        for b in args.batches:
            prompts = task_prompts(args.data, task, max(2 * b, args.min_prompts))
            engine.max_batch_size = b
            prior = SpecStats()              # earlier shards of this task: warm-up runs until calibrated
            for _ in range(args.max_warmups):
                warm = engine.auto_policy(prior=prior)
                engine.generate(prompts, params, gamma=warm)
                prior = prior.merge(engine.last_stats.counts())
                if prior.reached and prior.reached[0] >= warm.calibration_rows:
                    break
            cells[(task, b)] = {"prompts": prompts, "prior": prior, "times": {}, "picked": Counter()}
    for rep in range(args.reps):
        for (task, b), cell in cells.items():
            engine.max_batch_size = b
            for g in systems if rep % 2 == 0 else systems[::-1]:
                before = (engine.costs.profiles_taken, engine.costs.fits, engine.costs.fit_seconds)
                gamma = engine.auto_policy(prior=cell["prior"]) if g == "auto" else 0 if g == CONTROL else g
                dt, tokens = timed(engine, cell["prompts"], params, gamma)
                cell["times"].setdefault(g, []).append(tokens / dt)
                steps = engine.last_stats.steps
                cell.setdefault("overhead_ms", {}).setdefault(g, []).append(
                    1e3 * sum(st.overhead_s for st in steps) / max(len(steps), 1))
                if g == "auto":
                    cell.setdefault("auto_calls", []).append({
                        "seconds": dt, "steps": len(steps), "profiles_taken": engine.costs.profiles_taken - before[0],
                        "fits": engine.costs.fits - before[1], "fit_s": engine.costs.fit_seconds - before[2]})
                    cell["picked"].update(d.gamma for d in engine.last_policy.decisions)
                    first = next((d for d in engine.last_policy.decisions if d.predicted_goodput), None)
                    cell["reason"] = first.reason if first else ""
                    cell["predicted"] = first.predicted_goodput if first else []
    report = {"machine": {"platform": platform.platform(), "device": str(engine.device),
                          "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
              "model": str(args.model), "new_tokens": args.new, "reps": args.reps, "cells": []}
    print(f"model {args.model} on {engine.device} ({torch.get_num_threads()} threads)\n")
    print("| task | batch | " + " | ".join(f"gamma={g}" for g in fixed)
          + " | auto | auto / best fixed | auto / gamma 0 | paired: auto / best | paired: auto / gamma 0"
          + " | control, paired: gamma 0 again / gamma 0 | paired: auto / control | auto picked (steps) |")
    print("|---|---|" + "---|" * (len(fixed) + 8))
    for (task, b), cell in cells.items():
        runs = cell["times"]
        tps = {g: statistics.median(v) for g, v in runs.items()}
        best_g = max(fixed, key=lambda g: tps[g])
        paired_best, paired_0, control, auto_control = (paired(runs[a], runs[f]) for a, f in (
            ("auto", best_g), ("auto", 0), (CONTROL, 0), ("auto", CONTROL)))
        picked = ", ".join(f"{g}:{n}" for g, n in sorted(cell["picked"].items()))
        print(f"| {task} | {b} | " + " | ".join(f"{tps[g]:.0f}" for g in fixed)
              + f" | {tps['auto']:.0f} | {tps['auto'] / tps[best_g]:.2f} | {tps['auto'] / tps[0]:.2f}"
              + f" | {show(paired_best)} | {show(paired_0)} | {show(control)} | {show(auto_control)} | {picked} |")
        report["cells"].append({"task": task, "batch": b, "tokens_per_s": {str(g): v for g, v in tps.items()},
                                "auto_over_best_fixed": tps["auto"] / tps[best_g], "auto_over_gamma0": tps["auto"] / tps[0],
                                "best_fixed_gamma": best_g, "paired_auto_over_best_fixed": paired_best,
                                "paired_auto_over_gamma0": paired_0, "paired_control_over_gamma0": control,
                                "paired_auto_over_control": auto_control,
                                "auto_steps_per_gamma": dict(cell["picked"]), "auto_reason": cell.get("reason", ""),
                                "prior_acceptance_by_depth": cell["prior"].acceptance_by_depth(),
                                "prior_row_steps_drafted": cell["prior"].reached[0] if cell["prior"].reached else 0,
                                "auto_first_predicted_tokens_per_s": cell.get("predicted", []),
                                "tokens_per_s_per_rep": {str(g): v for g, v in runs.items()},
                                "auto_calls": cell.get("auto_calls", []),
                                "overhead_ms_per_step": {str(g): statistics.median(v) for g, v in cell["overhead_ms"].items()}})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
