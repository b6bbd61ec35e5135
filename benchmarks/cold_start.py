"""Cold start: a fresh engine's first `gamma="auto"` call against plain decoding and fixed gammas.

Each rep builds a fresh Engine (load time not counted) and times its first call with
gamma="auto" on the same handful of prompts at batch 1: the profile (or its on-disk cache),
any calibration and the decoding all count, as a new user sees them. The fixed gammas, and auto
once more, are timed on a warmed engine (so fresh auto / warm auto is what cold start costs). Reps alternate the systems so that machine noise hits all alike; ratios are
of medians within the run.

    python benchmarks/cold_start.py --prompts 4 --reps 3 [--no-cache] [--no-prior] [--draft mtp] [--transformers]

`--fresh-gammas 2,3` also times a fresh engine's first call at each of those fixed gammas: the
cold engine costs (first forwards at each shape) that every system's first call pays, so fresh
auto / best fresh fixed is what the policy's cold start costs on its own.

`--clock virtual` charges model forwards a fixed price per shape (pipeline/bench/virtual_clock.py):
the same prices for every system and rep, so the ratios read the policy's decisions, not the
machine's noise (transformers, if asked for, keeps real time).

`--transformers` also times transformers `generate()` on the same prompts, one at a time (greedy,
the same EOS), as a whole call like the engine's: the baseline a new user would compare against.

`--draft` is passed to every call (default mtp: the heads' gamma policy, which the profile and
calibration steer). With `auto` or `ngram` the warm engine's n-gram index holds the outputs of
these very prompts from the earlier reps, so warm calls draft their own answers: not a cold-start
comparison.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere
DEMO = ROOT / "pipeline" / "assets" / "demo"

from pipeline.bench.virtual_clock import add_clock_args, clock_from_args  # noqa: E402


def demo_prompts(n: int, task: str) -> list[str]:
    rows = pq.read_table(DEMO / "data" / "demo.parquet", columns=["task", "prompt"]).to_pylist()
    return [r["prompt"] for r in rows if r["task"] == task][-n:]      # the file's last rows


def timed(engine, prompts, params, gamma, draft="mtp", task=None) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, gamma=gamma, draft=draft, task=task)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def hf_timer(path: str, engine):
    """A timed transformers generate() over the prompts at batch 1, greedy (same tokens as the engine)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              trust_remote_code=False).eval()
    eos = list(engine.config.eos_token_ids or ()) or None
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else (eos or [0])[0]

    def timed_hf(prompts, params) -> tuple[float, int]:
        t0, n = time.perf_counter(), 0
        for prompt in prompts:
            ids = torch.tensor([engine.tokenizer(prompt)["input_ids"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=pad)
            n += out.shape[1] - ids.shape[1]
        return time.perf_counter() - t0, n
    return timed_hf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEMO / "model"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--task", default="summarize")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--gammas", default="0,1,2,3,4,5")
    ap.add_argument("--fresh-gammas", default="", help="also time a fresh engine's first call at these fixed gammas")
    ap.add_argument("--no-cache", action="store_true", help="a cold profile on every fresh engine")
    ap.add_argument("--no-prior", action="store_true", help="ignore the checkpoint's spec_prior.json")
    ap.add_argument("--name-task", action="store_true",
                    help="pass task= to every call (the checkpoint's prior of that task; default: no task named)")
    ap.add_argument("--draft", default="mtp", help="draft= of every call (module docstring)")
    ap.add_argument("--transformers", action="store_true", help="also time transformers generate() (docstring)")
    add_clock_args(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with clock_from_args(args):
        run(args)


def run(args) -> None:
    from pipeline.engine import Engine, SamplingParams

    if args.no_cache:
        os.environ["SPECBATCH_CACHE"] = tempfile.mkdtemp(prefix="cold-")
    prompts = demo_prompts(args.prompts, args.task)
    task = args.task if args.name_task else None
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    gammas = [int(g) for g in args.gammas.split(",")]
    fresh_gammas = [int(g) for g in args.fresh_gammas.split(",")] if args.fresh_gammas else []
    warm = Engine.from_pretrained(args.model, device="cpu", dtype="float32", max_batch_size=1)
    warm.generate(prompts[:1], SamplingParams(max_new_tokens=8), gamma=0)
    timed_hf = hf_timer(args.model, warm) if args.transformers else None
    if timed_hf is not None:
        timed_hf(prompts[:1], SamplingParams(max_new_tokens=8))
    times: dict[str, list[float]] = {}
    tokens = {}
    for rep in range(args.reps):
        if args.no_cache:
            os.environ["SPECBATCH_CACHE"] = tempfile.mkdtemp(prefix="cold-")
        fresh = Engine.from_pretrained(args.model, device="cpu", dtype="float32", max_batch_size=1)
        if args.no_prior:
            fresh.spec_prior = None
        s, n = timed(fresh, prompts, params, "auto", args.draft, task)
        times.setdefault("auto (fresh engine, first call)", []).append(s)
        tokens["auto"] = n
        pol = fresh.last_policy
        calib = sum(1 for d in getattr(pol, "decisions", []) if getattr(d, "calibrating", False))
        print(f"rep {rep}: fresh auto {s:.2f}s, {n} tokens, {calib} calibration steps, "
              f"profiles {fresh.costs.profiles_taken} (cached {getattr(fresh.costs, 'profile_cached', '?')})",
              flush=True)
        for g in fresh_gammas:        # the same cold engine, at a fixed gamma: what any system's first call pays
            cold = Engine.from_pretrained(args.model, device="cpu", dtype="float32", max_batch_size=1)
            s, n = timed(cold, prompts, params, g, args.draft, task)
            times.setdefault(f"gamma={g} (fresh engine, first call)", []).append(s)
        s, n = timed(warm, prompts, params, "auto", args.draft, task)
        times.setdefault("auto (warm engine)", []).append(s)
        for g in gammas:
            s, n = timed(warm, prompts, params, g, args.draft, task)
            times.setdefault(f"gamma={g}", []).append(s)
        if timed_hf is not None:
            s, n = timed_hf(prompts, params)
            times.setdefault("transformers generate()", []).append(s)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = min((k for k in med if k.startswith("gamma=") and "fresh" not in k), key=med.get)
    fresh_fixed = [k for k in med if k.startswith("gamma=") and "fresh" in k]
    best_fresh = min(fresh_fixed, key=med.get) if fresh_fixed else None
    print(f"\nmodel {args.model}, {args.prompts} {args.task} prompts at batch 1, "
          f"max_new_tokens {args.max_new_tokens}, {args.reps} reps, 1 torch thread")
    ref = f" | speed vs best fresh fixed ({best_fresh})" if best_fresh else ""
    print(f"| system | median s | speed vs gamma=0 | speed vs best fixed ({best}){ref} |")
    print("|---|---|---|---|" + ("---|" if best_fresh else ""))
    for k, v in med.items():
        extra = f" | {med[best_fresh] / v:.2f}" if best_fresh else ""
        print(f"| {k} | {v:.3f} | {med['gamma=0'] / v:.2f} | {med[best] / v:.2f}{extra} |")
    auto = times["auto (fresh engine, first call)"]
    for other in (best, *([best_fresh] if best_fresh else []), "gamma=0", "auto (warm engine)") + (("transformers generate()",) if timed_hf else ()):
        paired = [b / a for a, b in zip(auto, times[other])]
        print(f"paired per rep, fresh auto vs {other}: median {statistics.median(paired):.2f} "
              f"(min {min(paired):.2f}, max {max(paired):.2f})")


if __name__ == "__main__":
    main()
