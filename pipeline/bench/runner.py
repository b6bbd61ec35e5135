"""The benchmark matrix: systems x batch sizes x tasks x temperatures x prompt lengths.

Every cell's systems run on the same prompts, interleaved over repetitions (pipeline.bench.repeat)
so that machine noise hits all of them alike; each number is the median over repetitions.
`run_matrix` is load, make cells, warm up, time; `+job=bench` and benchmarks/engine_speed.py
run it with different specs.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.bench.prompts import RANDOM, random_prompts, task_prompts
from pipeline.bench.repeat import paired, run_order
from pipeline.bench.roofline import Roofline, measure_roofline
from pipeline.bench.systems import Measurement, merged, percentile, run_engine, run_transformers
from pipeline.engine import Engine, SamplingParams


@dataclass(frozen=True)
class BenchSpec:
    model_path: str
    data_path: str | None                  # Parquet with task, text; None: only task "random"
    out_dir: str
    batches: tuple[int, ...] = (1, 8, 32, 64)
    tasks: tuple[str, ...] = ("summarize", "complete", "json")    # or "random": random token ids
    temperatures: tuple[float, ...] = (0.0, 0.7)
    prompt_lengths: tuple[str, ...] = ("short", "long")
    long_prompt_tokens: int = 384
    random_prompt_tokens: int = 32         # a short random prompt's length
    gammas: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    auto: bool = True
    transformers: bool = True
    prompt_lookup_tokens: int = 3          # 0: skip prompt-lookup decoding
    max_new_tokens: int = 64
    ignore_eos: bool = False               # true: every row generates exactly max_new_tokens
    reps: int = 3
    device: str = "auto"
    seed: int = 0
    threads: int = 0                       # torch CPU threads (0: torch's default)
    drafts: tuple[str, ...] = ()           # gamma=auto with these draft sources too ("auto", "ngram", ...)
    layouts: tuple[str, ...] = ()          # draft=auto again with these verify layouts ("padded", "packed")
    min_rows: int = 1                      # prompts per cell at least (a batch-1 cell decodes them in turn)
    gamma_max: int = 0                     # caps auto (0: the largest of `gammas`)
    index_rows: int = 480                  # rows of each task (not the cells') whose outputs seed the n-gram index
    auto_engine: str = "own"               # "own": auto's systems on an engine of their own; "shared": one engine


@dataclass
class Cell:
    task: str
    temperature: float
    prompt_length: str
    batch: int
    prompts: list[list[int]]
    results: dict = field(default_factory=dict)      # system -> list[Measurement]

    def key(self) -> str:
        return f"{self.task}/T={self.temperature}/{self.prompt_length}/b={self.batch}"


@dataclass
class Systems:
    """What the systems run on: the engine of the fixed gammas, transformers' model (None when
    not measured), and the engine of the systems whose gamma auto chooses (`auto`; the same
    engine where BenchSpec.auto_engine is "shared"). An engine of its own holds the same loaded
    model (weights shared, so no copy's memory or placement differs) with its own caches, cost
    tracker and policy state: auto prices shapes by its own steps only, as in a job; on a shared
    one the fixed gammas' calls set the prices it reads (docs/decisions.md, stop 55)."""
    engine: Engine
    hf: object | None
    pad_id: int
    eos_ids: tuple
    roofline: Roofline
    indexes: dict = field(default_factory=dict)     # task -> the n-gram index each timed call starts from
    auto: Engine | None = None

    def __post_init__(self):
        self.auto = self.auto or self.engine

    def engines(self) -> list[Engine]:
        return [self.engine] if self.auto is self.engine else [self.engine, self.auto]


def load_systems(spec: BenchSpec) -> Systems:
    import transformers

    engine = Engine.from_pretrained(spec.model_path, device=spec.device, max_batch_size=max(spec.batches),
                                    gamma_max=spec.gamma_max or max(spec.gammas))
    hf = None
    if spec.transformers:
        hf = transformers.AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=engine.dtype,
                                                               trust_remote_code=False).to(engine.device).eval()
    tok = engine.tokenizer
    eos = tuple(engine.config.eos_token_ids or ())
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else (eos or (0,))[0]
    roofline = measure_roofline(engine)
    engine.ensure_profile()
    auto = None
    if spec.auto_engine == "own" and (spec.auto or spec.drafts or spec.layouts):
        auto = Engine(engine.model, engine.tokenizer, max_batch_size=engine.max_batch_size,   # the same weights
                      gamma_max=engine.gamma_max)
        auto.ensure_profile()
    elif spec.auto_engine not in ("own", "shared"):
        raise ValueError(f"bench.auto_engine must be own or shared, not {spec.auto_engine!r}")
    return Systems(engine, hf, pad, () if spec.ignore_eos else eos, roofline, auto=auto)


def cell_prompts(spec: BenchSpec, engine: Engine, task: str, length: str, n: int) -> list[list[int]]:
    """n token-id prompts of `task` at `length` ("short" or "long")."""
    if task == RANDOM:
        size = spec.long_prompt_tokens if length == "long" else spec.random_prompt_tokens
        return random_prompts(n, engine.config.vocab_size, size, spec.seed)
    return task_prompts(spec.data_path, task, n, engine.tokenizer,
                        spec.long_prompt_tokens if length == "long" else 0)


def make_cells(spec: BenchSpec, engine: Engine) -> list[Cell]:
    return [Cell(t, temp, length, b, cell_prompts(spec, engine, t, length, max(b, spec.min_rows)))
            for t in spec.tasks for temp in spec.temperatures for length in spec.prompt_lengths for b in spec.batches]


def systems_for(spec: BenchSpec, batch: int) -> list[str]:
    names = ["transformers"] if spec.transformers else []
    if spec.transformers and spec.prompt_lookup_tokens and batch == 1:
        names.append("prompt_lookup")
    names += [f"gamma={g}" for g in spec.gammas]
    if spec.auto:
        names.append("auto")
    names += [f"draft={d}" for d in spec.drafts]
    names += [f"draft=auto/{layout}" for layout in spec.layouts]
    return names


def task_indexes(spec: BenchSpec, sut: Systems, cells: list[Cell]) -> dict:
    """task -> a TaskIndex of the outputs of `index_rows` rows of the task that no cell uses,
    as earlier shards of the task leave it on an actor (each timed call starts from a copy, so no
    call sees its own or an earlier repetition's outputs)."""
    from pipeline.engine.drafters import TaskIndex
    from pipeline.engine.run import TASK_INDEX_TOKENS

    if not (spec.drafts or spec.layouts) or spec.data_path is None:
        return {}
    skip = max(max(len(c.prompts) for c in cells), 1)
    out = {}
    for task in {c.task for c in cells if c.task != RANDOM}:
        prompts = task_prompts(spec.data_path, task, skip + spec.index_rows, sut.engine.tokenizer)[skip:]
        index = TaskIndex(TASK_INDEX_TOKENS)
        for o in sut.engine.generate(prompts, SamplingParams(max_new_tokens=spec.max_new_tokens), gamma=0, draft="none"):
            index.add(o.token_ids)
        out[task] = index
    return out


def warm_up(spec: BenchSpec, sut: Systems, cells: list[Cell]) -> dict:
    """One untimed call per cell and system kind on each engine; returns auto's acceptance prior
    per cell, as earlier shards of the task give it (from at least 8 rows)."""
    priors = {}
    for cell in cells:
        warm = cell.prompts if cell.batch >= 8 else cell_prompts(spec, sut.engine, cell.task, cell.prompt_length, 8)
        for engine in sut.engines():
            engine.max_batch_size = cell.batch
            engine.generate(warm, _params(spec, cell), gamma=engine.auto_policy(task=cell.task),
                            draft="mtp" if "mtp" in engine.draft_names else "none", task=cell.task)
            priors[cell.key()] = engine.last_stats.counts()      # the auto engine's (the last)
        if spec.drafts or spec.layouts:        # the n-gram source's acceptance by match length, likewise
            _fresh_index(sut, cell)
            sut.auto.ngram_evidence.pop(cell.task, None)
            sut.auto.generate(warm, _params(spec, cell), gamma="auto", draft="ngram", task=cell.task)
        if sut.hf is not None:
            run_transformers(sut.hf, cell.prompts[:1], _params(spec, cell, new=4), sut.pad_id, sut.eos_ids)
    return priors


def measure(spec: BenchSpec, sut: Systems, cell: Cell, name: str, prior) -> Measurement:
    """One timed call of system `name` on the cell's prompts."""
    params = _params(spec, cell)
    if name in ("transformers", "prompt_lookup"):   # a cell of more prompts than its batch: in turn
        lookup = spec.prompt_lookup_tokens if name == "prompt_lookup" else 0
        return merged([run_transformers(sut.hf, cell.prompts[i:i + cell.batch], params, sut.pad_id, sut.eos_ids,
                                        lookup=lookup) for i in range(0, len(cell.prompts), cell.batch)])
    if name.startswith("draft="):
        draft, _, layout = name.split("=")[1].partition("/")
        _fresh_index(sut, cell)
        sut.auto.verify_layout = layout or "auto"
        try:
            return run_engine(sut.auto, cell.prompts, params, sut.auto.auto_policy(prior=prior, task=cell.task), sut.roofline,
                              draft=draft, task=cell.task)
        finally:
            sut.auto.verify_layout = "auto"
    if name == "auto":
        mtp_only = "mtp" if "mtp" in sut.auto.draft_names else "none"   # the heads' policy alone
        return run_engine(sut.auto, cell.prompts, params, sut.auto.auto_policy(prior=prior, task=cell.task), sut.roofline,
                          draft=mtp_only, task=cell.task)
    return run_engine(sut.engine, cell.prompts, params, int(name.split("=")[1]), sut.roofline, draft="auto",
                      task=cell.task)


def _fresh_index(sut: Systems, cell: Cell) -> None:
    """The task's n-gram index on the auto engine as the warm-up left it
    (pipeline.bench.runner.task_indexes)."""
    import copy

    seed = sut.indexes.get(cell.task)
    if seed is None:
        sut.auto.task_indexes.pop(cell.task, None)
    else:
        sut.auto.task_indexes[cell.task] = copy.deepcopy(seed)


def time_cells(spec: BenchSpec, sut: Systems, cells: list[Cell], priors: dict, log=print) -> None:
    """`spec.reps` interleaved repetitions of every system in every cell, into `cell.results`."""
    for rep in range(spec.reps):
        for cell in cells:
            for engine in sut.engines():
                engine.max_batch_size = cell.batch
            for name in run_order(systems_for(spec, cell.batch), rep):
                m = measure(spec, sut, cell, name, priors[cell.key()])
                cell.results.setdefault(name, []).append(m)
            log(f"rep {rep + 1}/{spec.reps} {cell.key()} done")


def run_matrix(spec: BenchSpec, log=print) -> dict:
    """Measure the whole matrix: {"engine", "roofline", "cells": [summarize_cell(...)]}."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    sut = load_systems(spec)
    cells = make_cells(spec, sut.engine)
    sut.indexes = task_indexes(spec, sut, cells)
    priors = warm_up(spec, sut, cells)
    time_cells(spec, sut, cells, priors, log)
    return {"engine": sut.engine, "roofline": sut.roofline, "cells": [summarize_cell(c) for c in cells]}


def _params(spec: BenchSpec, cell: Cell, new: int | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=new or spec.max_new_tokens, temperature=cell.temperature, seed=spec.seed,
                          ignore_eos=spec.ignore_eos)


def summarize_cell(cell: Cell) -> dict:
    out = {"task": cell.task, "temperature": cell.temperature, "prompt_length": cell.prompt_length,
           "batch": cell.batch, "rows": len(cell.prompts),
           "prompt_tokens": statistics.mean(len(p) for p in cell.prompts), "systems": {}}
    for name, ms in cell.results.items():
        latencies = [x for m in ms for x in m.token_latency_s]
        roof = [m.roofline_s / m.decode_s for m in ms if m.roofline_s]
        out["systems"][name] = {
            "tokens_per_s": statistics.median(m.tokens_per_s for m in ms),
            "prefill_s": statistics.median(m.prefill_s for m in ms),
            "p50_token_latency_ms": _ms(percentile(latencies, 50)),
            "p95_token_latency_ms": _ms(percentile(latencies, 95)),
            "mean_acceptance_length": ms[-1].mean_acceptance_length,
            "roofline_fraction": statistics.median(roof) if roof else None,
            "drafted_by_source": ms[-1].drafted_by_source, "accepted_by_source": ms[-1].accepted_by_source,
            "draft_share": statistics.median(m.draft_s / m.decode_s for m in ms) if ms[-1].decode_s else None,
        }
    out["paired"] = paired_ratios(cell.results, out["systems"])
    return out


def paired_ratios(results: dict, systems: dict) -> dict:
    """For each policy system (auto, draft=...): its tokens/s over gamma 0's and over the best fixed
    gamma's (by median), repetition by repetition (pipeline.bench.repeat.paired), which cancels the
    machine's swings between repetitions that a ratio of medians keeps.
    Example: auto [10, 12], gamma=0 [8, 12] -> {"auto": {"gamma=0": {"median": 1.125, ...}, ...}}."""
    runs = {name: [m.tokens_per_s for m in ms] for name, ms in results.items()}
    fixed = {k: v["tokens_per_s"] for k, v in systems.items() if k.startswith("gamma=") and v["tokens_per_s"] > 0}
    best = max(fixed, key=fixed.get) if fixed else None      # NaN (nothing decoded) is never > 0
    out = {}
    for name, xs in runs.items():
        if name != "auto" and not name.startswith("draft="):
            continue
        against = {k: runs[k] for k in dict.fromkeys(("gamma=0", best)) if k in runs}
        out[name] = {k: paired(xs, ys) for k, ys in against.items()
                     if len(ys) == len(xs) and all(v > 0 for v in xs + ys)}
    return out


def _ms(x):
    return None if x is None else 1000 * x


def device_description(engine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    import platform
    return f"CPU {platform.machine()} ({torch.get_num_threads()} torch threads)"


def machine_info(spec: BenchSpec, result: dict) -> dict:
    """The report's header: device, measured ceilings, model, what each cell generated."""
    engine, roof = result["engine"], result["roofline"]
    return {"device": device_description(engine), "dtype": str(engine.dtype).replace("torch.", ""),
            "flops": roof.flops, "bandwidth": roof.bandwidth, "params": roof.params,
            "model": Path(spec.model_path).name, "max_new_tokens": spec.max_new_tokens, "reps": spec.reps}
