"""The benchmark matrix: systems x batch sizes x tasks x temperatures x prompt lengths.

Every cell's systems run on the same prompts, in round-robin over repetitions so that machine
noise hits all of them alike; each number is the median over repetitions.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq
import torch

from pipeline.bench.roofline import measure_roofline
from pipeline.bench.systems import percentile, run_engine, run_transformers
from pipeline.demo.tasks import TEMPLATES      # the demo tasks' prompt formats
from pipeline.engine import Engine, SamplingParams



@dataclass(frozen=True)
class BenchSpec:
    model_path: str
    data_path: str
    out_dir: str
    batches: tuple[int, ...] = (1, 8, 32, 64)
    tasks: tuple[str, ...] = ("summarize", "complete", "json")
    temperatures: tuple[float, ...] = (0.0, 0.7)
    prompt_lengths: tuple[str, ...] = ("short", "long")
    long_prompt_tokens: int = 384
    gammas: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    auto: bool = True
    transformers: bool = True
    prompt_lookup_tokens: int = 3          # 0: skip prompt-lookup decoding
    max_new_tokens: int = 64
    reps: int = 3
    device: str = "auto"
    seed: int = 0
    threads: int = 0                       # torch CPU threads (0: torch's default)


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


def task_prompts(spec: BenchSpec, tokenizer, task: str, length: str, n: int) -> list[list[int]]:
    """n prompts of `task`; long ones carry other rows' texts before them as context."""
    texts = [r["text"] for r in pq.read_table(spec.data_path, columns=["task", "text"]).to_pylist()
             if r["task"] == task]
    out = []
    for i in range(n):
        prompt = TEMPLATES[task].format(text=texts[i % len(texts)])
        if length == "long":
            context, j = [], i + 1
            while len(tokenizer("\n\n".join(context + [prompt]))["input_ids"]) < spec.long_prompt_tokens:
                context.append(texts[j % len(texts)])
                j += 1
            prompt = "\n\n".join(context + [prompt])
        out.append(tokenizer(prompt)["input_ids"])
    return out


def systems_for(spec: BenchSpec, batch: int) -> list[str]:
    names = ["transformers"] if spec.transformers else []
    if spec.transformers and spec.prompt_lookup_tokens and batch == 1:
        names.append("prompt_lookup")
    names += [f"gamma={g}" for g in spec.gammas]
    if spec.auto:
        names.append("auto")
    return names


def run_matrix(spec: BenchSpec, log=print) -> dict:
    import transformers

    if spec.threads:
        torch.set_num_threads(spec.threads)
    engine = Engine.from_pretrained(spec.model_path, device=spec.device, max_batch_size=max(spec.batches),
                                    gamma_max=max(spec.gammas))
    hf = None
    if spec.transformers:
        hf = transformers.AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=engine.dtype,
                                                               trust_remote_code=False).to(engine.device).eval()
    tok = engine.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else (engine.config.eos_token_ids or (0,))[0]
    roofline = measure_roofline(engine)
    engine.ensure_profile()
    cells = [Cell(t, temp, length, b, task_prompts(spec, tok, t, length, b))
             for t in spec.tasks for temp in spec.temperatures for length in spec.prompt_lengths for b in spec.batches]
    priors = {}
    for cell in cells:      # warm-up; auto's acceptance prior, as earlier shards of the task give
        params = _params(spec, cell)
        engine.max_batch_size = cell.batch
        warm = cell.prompts if cell.batch >= 8 else task_prompts(spec, tok, cell.task, cell.prompt_length, 8)
        engine.generate(warm, params, gamma=engine.auto_policy())
        priors[cell.key()] = engine.last_stats.counts()
        if hf is not None:
            run_transformers(hf, cell.prompts[:1], _params(spec, cell, new=4), pad, engine.config.eos_token_ids)
    for rep in range(spec.reps):
        for cell in cells:
            params = _params(spec, cell)
            engine.max_batch_size = cell.batch
            for name in systems_for(spec, cell.batch):
                if name == "transformers":
                    m = run_transformers(hf, cell.prompts, params, pad, engine.config.eos_token_ids)
                elif name == "prompt_lookup":
                    m = run_transformers(hf, cell.prompts, params, pad, engine.config.eos_token_ids,
                                         lookup=spec.prompt_lookup_tokens)
                else:
                    gamma = engine.auto_policy(prior=priors[cell.key()]) if name == "auto" else int(name.split("=")[1])
                    m = run_engine(engine, cell.prompts, params, gamma, roofline)
                cell.results.setdefault(name, []).append(m)
            log(f"rep {rep + 1}/{spec.reps} {cell.key()} done")
    return {"engine": engine, "roofline": roofline, "cells": [summarize_cell(c) for c in cells]}


def _params(spec: BenchSpec, cell: Cell, new: int | None = None) -> SamplingParams:
    return SamplingParams(max_new_tokens=new or spec.max_new_tokens, temperature=cell.temperature, seed=spec.seed)


def summarize_cell(cell: Cell) -> dict:
    out = {"task": cell.task, "temperature": cell.temperature, "prompt_length": cell.prompt_length,
           "batch": cell.batch, "prompt_tokens": statistics.mean(len(p) for p in cell.prompts), "systems": {}}
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
        }
    return out


def _ms(x):
    return None if x is None else 1000 * x


def device_description(engine) -> str:
    if engine.device.type == "cuda":
        return torch.cuda.get_device_name(engine.device)
    import platform
    return f"CPU {platform.machine()} ({torch.get_num_threads()} torch threads)"
