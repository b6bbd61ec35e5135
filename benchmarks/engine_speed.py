"""Engine tokens/s at gamma 0..G against transformers generate(), same checkpoint and prompts.

    python benchmarks/engine_speed.py                       # the demo model if built, else a synthetic one
    python benchmarks/engine_speed.py --model PATH --batches 1 8 32 --gammas 0 1 2 3 4 5

Greedy, EOS ignored so every row generates exactly --new tokens. Each (system, batch) cell is
run --reps times, interleaved round-robin so machine noise hits all systems alike; the median
is reported, and ratios are taken within this one run. Timing covers the whole generate call
(prefill included) for both systems. Writes a Markdown table to stdout and JSON to --out.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from pipeline.engine import Engine, SamplingParams
from pipeline.model.tiny import make_tiny_checkpoint

DEMO = Path(__file__).resolve().parents[1] / "pipeline" / "assets" / "demo" / "model"


def synthetic_checkpoint(root: Path) -> Path:
    """A demo-sized Llama (about 5M parameters) whose heads draft well by construction."""
    return make_tiny_checkpoint(root / "synthetic", arch="llama", num_mtp_layers=1, vocab_size=4096,
                                hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                                intermediate_size=768, max_position_embeddings=1024,
                                initializer_range=0.05, draftable=0.1, with_tokenizer=False)


def prompts_for(batch: int, vocab: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


def time_engine(engine: Engine, prompts, new: int, gamma: int) -> tuple[float, dict]:
    engine.reset_stats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=new, ignore_eos=True), gamma=gamma)
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == new for o in outs)
    return dt, {"mean_acceptance_length": engine.stats.mean_acceptance_length(),
                "acceptance_by_depth": engine.stats.acceptance_by_depth()}


@torch.inference_mode()
def time_hf(model, prompts, new: int, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):                     # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=pad_id)
    dt = time.perf_counter() - t0
    assert out.shape[1] == width + new
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--gammas", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    ap.add_argument("--new", type=int, default=64, help="tokens generated per row")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_speed.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    path = args.model or (DEMO if (DEMO / "config.json").exists() else synthetic_checkpoint(Path(tmp.name)))
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32", max_batch_size=max(args.batches),
                                    gamma_max=max(args.gammas))
    gammas = [g for g in args.gammas if g == 0 or engine.num_mtp_heads]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    pad = engine.config.eos_token_ids[0] if engine.config.eos_token_ids else 0
    systems = ["transformers"] + [f"gamma={g}" for g in gammas]
    times = {(s, b): [] for s in systems for b in args.batches}
    spec = {}
    for b in args.batches:                               # warm-up, one of each
        p = prompts_for(b, engine.config.vocab_size, args.prompt_len, 0)
        time_hf(hf, p, 4, pad)
        time_engine(engine, p, 4, 0)
    for rep in range(args.reps):
        for b in args.batches:
            engine.max_batch_size = b
            p = prompts_for(b, engine.config.vocab_size, args.prompt_len, rep)
            times[("transformers", b)].append(time_hf(hf, p, args.new, pad))
            for g in gammas:
                dt, info = time_engine(engine, p, args.new, g)
                times[(f"gamma={g}", b)].append(dt)
                spec[(g, b)] = info
    tps = {k: len(prompts_for(k[1], 10, 1, 0)) * args.new / statistics.median(v) for k, v in times.items()}
    report = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                          "transformers": transformers.__version__},
              "model": str(path), "new_tokens": args.new, "prompt_len": args.prompt_len, "reps": args.reps,
              "tokens_per_s": {f"{s}@{b}": round(v, 1) for (s, b), v in tps.items()},
              "acceptance": {f"gamma={g}@{b}": v for (g, b), v in spec.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"model: {path}\nmachine: {report['machine']}\n")
    print("| system | " + " | ".join(f"batch {b} tok/s (x transformers)" for b in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for s in systems:
        cells = [f"{tps[(s, b)]:.0f} ({tps[(s, b)] / tps[('transformers', b)]:.2f}x)" for b in args.batches]
        print(f"| {s} | " + " | ".join(cells) + " |")
    print("\nmean acceptance length: " + ", ".join(
        f"gamma={g}: {spec[(g, args.batches[0])]['mean_acceptance_length']:.2f}" for g in gammas if g))


if __name__ == "__main__":
    main()
