"""Step and draft-depth cost of candidate demo-model shapes, random weights (no training).

    python benchmarks/model_candidates.py                  # 12x192, 16x160, 12x256 and the demo's 4x256
    python benchmarks/model_candidates.py --shapes 12x192 --vocab 6144 --reps 31

Each candidate is a random Llama checkpoint (tied embeddings, one MTP head, head_dim 32, MLP 3x
hidden) built in a temporary folder; `pipeline.bench.step_costs.measure` times it at batch 1,
context 64, over the full vocabulary and each `--draft-vocab` size (skipped on trees without
draft vocabularies), and as "baseline" (benchmarks/step_costs.py --compare: this branch's step
changes off), all variants of a shape interleaved in one loop. Prints parameters, bf16 size,
gamma-0 step ms and depth / step.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

import torch  # noqa: E402

from pipeline.bench.step_costs import baseline_engine, measure_many  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline.model.tiny import make_tiny_checkpoint  # noqa: E402

KV_HEADS = {160: 1, 192: 2, 256: 4}


def build(root: Path, layers: int, hidden: int, vocab: int) -> Path:
    heads = hidden // 32
    return make_tiny_checkpoint(root / f"{layers}x{hidden}", arch="llama", num_mtp_layers=1, vocab_size=vocab,
                                hidden_size=hidden, num_layers=layers, num_heads=heads,
                                num_kv_heads=KV_HEADS.get(hidden, heads), intermediate_size=3 * hidden,
                                max_position_embeddings=1024, initializer_range=0.02, tie_word_embeddings=True,
                                with_tokenizer=False)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["4x256", "12x192", "16x160", "12x256"])
    ap.add_argument("--vocab", type=int, default=6144)
    ap.add_argument("--draft-vocab", type=int, nargs="*", default=[2048, 1024])
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall", help="as in benchmarks/step_costs.py")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| shape | params (M) | bf16 MB | variant | step ms | depth ms | depth/step |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            layers, hidden = (int(x) for x in shape.split("x"))
            path = build(Path(tmp), layers, hidden, args.vocab)
            engines = {"baseline": baseline_engine(path, "cpu"), "lean": Engine.from_pretrained(path, device="cpu")}
            for vd in args.draft_vocab:
                engines[f"lean, Vd {vd}"] = Engine.from_pretrained(path, device="cpu")
                engines[f"lean, Vd {vd}"].heads[0].set_draft_vocab(torch.arange(vd))
            lean = engines["lean"]
            params = sum(p.numel() for n, p in lean.target.named_parameters() if not n.startswith("tied_head."))
            params += sum(p.numel() for h in lean.heads for p in h.parameters())
            costs = measure_many(engines, rows=1, ctx=64, q_max=1, reps=args.reps, draft_gammas=(1, 3),
                                 clock=time.thread_time if args.clock == "cpu" else time.perf_counter)
            for name, c in costs.items():
                step, depth = c.verify_s[1], c.depth_s()
                print(f"| {shape} | {params / 1e6:.2f} | {2 * params / 1e6:.1f} | {name} | {1e3 * step:.2f} | "
                      f"{1e3 * depth:.2f} | {depth / step:.2f} |", flush=True)

if __name__ == "__main__":
    main()
