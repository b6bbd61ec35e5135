"""The gamma-policy benchmark: `auto` against every fixed gamma, per demo task and batch size.

For each task and batch size B the same prompts (max(2B, min_prompts) rows of the task, so
continuous batching keeps about B rows active and a batch-1 call lasts long enough to time) are
generated greedily, EOS respected, at each fixed gamma, at `auto`, and at gamma 0 a second time
(the control). `auto` runs as a steady-state shard does: with the acceptance prior of earlier
warm-up runs of the task, repeated until the policy's calibration is done. Repetitions are
interleaved (pipeline.bench.repeat); ratios are of medians and paired. control / gamma 0 is
what two identical systems measure apart on this machine, the noise floor auto / gamma 0 is read
against; the control runs next to auto, so auto / control compares neighbours in the run order.
Every call drafts with the heads alone (`draft="mtp"`): the same prompts run again and again
here, so an n-gram index would draft each call's answers from the previous call's (the draft
sources have their own benchmark, benchmarks/draft_sources.py, which resets the index).
Entry: benchmarks/gamma_policy.py.
"""
from __future__ import annotations

import platform
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from pipeline.bench.prompts import task_prompts
from pipeline.bench.repeat import paired, run_order, show_paired
from pipeline.demo.tasks import TEMPLATES
from pipeline.engine import Engine, SamplingParams
from pipeline.engine.params import DEFAULT_GAMMA_MAX
from pipeline.spec_decode.stats import SpecStats

CONTROL = "gamma=0 again"        # gamma 0 run twice per repetition: the machine's noise floor


@dataclass(frozen=True)
class GammaPolicySpec:
    model_path: str
    data_path: str
    tasks: tuple[str, ...] = tuple(TEMPLATES)
    batches: tuple[int, ...] = (1, 48)
    gamma_max: int = DEFAULT_GAMMA_MAX
    max_new_tokens: int = 64
    reps: int = 7
    min_prompts: int = 24
    max_warmups: int = 8             # warm-up calls per cell at most (until calibrated)
    threads: int = 0                 # torch CPU threads (0: torch's default)
    device: str = "auto"


@dataclass
class Cell:
    task: str
    batch: int
    prompts: list[str]
    prior: SpecStats                                   # what the warm-up runs measured
    times: dict = field(default_factory=dict)          # system -> tokens/s per repetition
    overhead_ms: dict = field(default_factory=dict)    # system -> mean overhead per step, per repetition
    auto_calls: list = field(default_factory=list)     # per auto call: seconds, steps, profiles, fits
    picked: Counter = field(default_factory=Counter)   # gamma -> auto's steps at it
    reason: str = ""                                   # auto's first priced decision
    predicted: list = field(default_factory=list)      # its predicted goodput per gamma


def systems(spec: GammaPolicySpec) -> list:
    """Every fixed gamma, then the control and auto (so the two are neighbours in either order)."""
    return list(range(spec.gamma_max + 1)) + [CONTROL, "auto"]


def load_engine(spec: GammaPolicySpec) -> Engine:
    if spec.threads:
        torch.set_num_threads(spec.threads)
    engine = Engine.from_pretrained(spec.model_path, device=spec.device, max_batch_size=max(spec.batches),
                                    gamma_max=spec.gamma_max)
    engine.ensure_profile()
    return engine


def warm_up(engine: Engine, spec: GammaPolicySpec, task: str, prompts: list[str],
            params: SamplingParams) -> SpecStats:
    """Runs of `auto` until the policy's calibration is done: the prior a later shard starts from."""
    prior = SpecStats()
    for _ in range(spec.max_warmups):
        warm = engine.auto_policy(prior=prior, task=task)
        engine.generate(prompts, params, gamma=warm, draft="mtp", task=task)
        prior = prior.merge(engine.last_stats.counts())
        if prior.reached and prior.reached[0] >= warm.calibration_rows:
            break
    return prior


def make_cells(engine: Engine, spec: GammaPolicySpec, params: SamplingParams) -> list[Cell]:
    cells = []
    for task in spec.tasks:
        for b in spec.batches:
            prompts = task_prompts(spec.data_path, task, max(2 * b, spec.min_prompts))
            engine.max_batch_size = b
            cells.append(Cell(task, b, prompts, warm_up(engine, spec, task, prompts, params)))
    return cells


def time_call(engine: Engine, cell: Cell, system, params: SamplingParams) -> None:
    """One timed call of `system` on the cell's prompts, recorded into the cell."""
    costs = engine.costs
    before = (costs.profiles_taken, costs.fits, costs.fit_seconds)
    gamma = engine.auto_policy(prior=cell.prior, task=cell.task) if system == "auto" else 0 if system == CONTROL else system
    t0 = time.perf_counter()
    outs = engine.generate(cell.prompts, params, gamma=gamma, draft="mtp", task=cell.task)
    dt = time.perf_counter() - t0
    steps = engine.last_stats.steps
    cell.times.setdefault(system, []).append(sum(len(o.token_ids) for o in outs) / dt)
    cell.overhead_ms.setdefault(system, []).append(1e3 * sum(st.overhead_s for st in steps) / max(len(steps), 1))
    if system == "auto":
        cell.auto_calls.append({"seconds": dt, "steps": len(steps), "profiles_taken": costs.profiles_taken - before[0],
                                "fits": costs.fits - before[1], "fit_s": costs.fit_seconds - before[2]})
        decisions = engine.last_policy.decisions
        cell.picked.update(d.gamma for d in decisions)
        first = next((d for d in decisions if d.predicted_goodput), None)
        cell.reason, cell.predicted = (first.reason, first.predicted_goodput) if first else ("", [])


def time_cells(engine: Engine, spec: GammaPolicySpec, cells: list[Cell], params: SamplingParams) -> None:
    for rep in range(spec.reps):
        for cell in cells:
            engine.max_batch_size = cell.batch
            for system in run_order(systems(spec), rep):
                time_call(engine, cell, system, params)


def summarize_cell(cell: Cell, fixed: list[int]) -> dict:
    """Medians, ratios of medians and paired ratios of one cell (the JSON report's entry)."""
    runs = cell.times
    tps = {g: statistics.median(v) for g, v in runs.items()}
    best = max(fixed, key=lambda g: tps[g])
    return {"task": cell.task, "batch": cell.batch, "tokens_per_s": {str(g): v for g, v in tps.items()},
            "auto_over_best_fixed": tps["auto"] / tps[best], "auto_over_gamma0": tps["auto"] / tps[0],
            "best_fixed_gamma": best, "paired_auto_over_best_fixed": paired(runs["auto"], runs[best]),
            "paired_auto_over_gamma0": paired(runs["auto"], runs[0]),
            "paired_control_over_gamma0": paired(runs[CONTROL], runs[0]),
            "paired_auto_over_control": paired(runs["auto"], runs[CONTROL]),
            "auto_steps_per_gamma": dict(cell.picked), "auto_reason": cell.reason,
            "prior_acceptance_by_depth": cell.prior.acceptance_by_depth(),
            "prior_row_steps_drafted": cell.prior.reached[0] if cell.prior.reached else 0,
            "auto_first_predicted_tokens_per_s": cell.predicted,
            "tokens_per_s_per_rep": {str(g): v for g, v in runs.items()},
            "auto_calls": cell.auto_calls,
            "overhead_ms_per_step": {str(g): statistics.median(v) for g, v in cell.overhead_ms.items()}}


def markdown_table(report: dict) -> str:
    fixed = [int(g) for g in report["cells"][0]["tokens_per_s"] if g.isdigit()] if report["cells"] else []
    lines = ["| task | batch | " + " | ".join(f"gamma={g}" for g in fixed)
             + " | auto | auto / best fixed | auto / gamma 0 | paired: auto / best | paired: auto / gamma 0"
             + " | control, paired: gamma 0 again / gamma 0 | paired: auto / control | auto picked (steps) |",
             "|---|---|" + "---|" * (len(fixed) + 8)]
    for c in report["cells"]:
        tps = c["tokens_per_s"]
        picked = ", ".join(f"{g}:{n}" for g, n in sorted(c["auto_steps_per_gamma"].items()))
        lines.append(f"| {c['task']} | {c['batch']} | " + " | ".join(f"{tps[str(g)]:.0f}" for g in fixed)
                     + f" | {tps['auto']:.0f} | {c['auto_over_best_fixed']:.2f} | {c['auto_over_gamma0']:.2f}"
                     + f" | {show_paired(c['paired_auto_over_best_fixed'])} | {show_paired(c['paired_auto_over_gamma0'])}"
                     + f" | {show_paired(c['paired_control_over_gamma0'])} | {show_paired(c['paired_auto_over_control'])}"
                     + f" | {picked} |")
    return "\n".join(lines)


def run_gamma_policy(spec: GammaPolicySpec) -> dict:
    """Load, warm up, time; the JSON-ready report (machine, settings, one entry per cell)."""
    engine = load_engine(spec)
    params = SamplingParams(max_new_tokens=spec.max_new_tokens, temperature=0.0)
    cells = make_cells(engine, spec, params)
    time_cells(engine, spec, cells, params)
    fixed = list(range(spec.gamma_max + 1))
    return {"machine": {"platform": platform.platform(), "device": str(engine.device),
                        "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
            "model": str(spec.model_path), "new_tokens": spec.max_new_tokens, "reps": spec.reps,
            "cells": [summarize_cell(c, fixed) for c in cells]}
