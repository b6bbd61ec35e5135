"""verify(q)/verify(1) and draft-depth/step ratios of a checkpoint (pipeline/bench/step_costs.py).

    python benchmarks/step_costs.py                                  # the demo model, batch 1 and 48
    python benchmarks/step_costs.py --model PATH --rows 1 48 --ctx 64 256 --threads 1
    python benchmarks/step_costs.py --compare        # lean against baseline, interleaved in one process
    python benchmarks/step_costs.py --compare-gemm   # float16-weight GEMM against float32, likewise
    python benchmarks/step_costs.py --compare-kernel # native float16-weight GEMM against FBGEMM's
    python benchmarks/step_costs.py --compare-norm   # the C RMSNorm against torch's
    python benchmarks/step_costs.py --compare-layer  # the C attention and decoder layer against torch's
    python benchmarks/step_costs.py --compare-source HEAD~1  # the C kernels of a commit against the tree's

--compare loads the checkpoint twice: "lean" as the engine runs it, and "baseline" with this
branch's step changes switched off (linears in the checkpoint's [out, in] layout, rotary
computed per forward, full-vocabulary drafts), and times both in one interleaved loop.
--compare-gemm does the same with "float32 GEMM", the engine with its CPU linears kept off
FBGEMM's float16-weight GEMM (pipeline/model/packed.py), beside the engine as it runs.
--compare-kernel: the engine with FBGEMM's float16-weight GEMM where it runs the native
half_gemm (pipeline/model/native.py), beside the engine as it runs.
--compare-norm: the engine with torch's RMSNorm where it runs the C one, beside it.
--compare-layer: the engine with torch's attention (RoPE, cache write, mask, SDPA), its layers
and heads as modules and its greedy drafting in Python, where it runs them as C calls, beside it.
--compare-source REV: the engine with the C kernels of git revision REV's half_gemm.c (built as
the engine builds its own), beside the engine with the working tree's.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

import torch  # noqa: E402

from pipeline.bench.step_costs import baseline_engine, measure, measure_many, table  # noqa: E402
from pipeline.engine import Engine  # noqa: E402
from pipeline.model import native  # noqa: E402
from pipeline.model.layers import Attention, DecoderLayer, RMSNorm  # noqa: E402
from pipeline.model.mtp import MTPHead  # noqa: E402

DEMO = ROOT / "pipeline" / "assets" / "demo" / "model"


def set_draft_vocab(engine, choice: str) -> None:
    """auto: the checkpoint's own; off: the full vocabulary; N: the first N ids (cost only: what a
    depth costs does not depend on which N tokens it drafts over)."""
    if choice == "auto":
        return
    ids = None if choice == "off" else torch.arange(int(choice), device=engine.device)
    for head in engine.heads:
        head.set_draft_vocab(ids)


def engine_without(args, switch_off) -> Engine:
    """The checkpoint loaded again with `switch_off(module)` applied to every module of its
    target and heads: the engine beside which the one as it runs is timed."""
    engine = Engine.from_pretrained(args.model, device=args.device)
    set_draft_vocab(engine, args.draft_vocab)
    for module in [*engine.target.modules(), *(m for h in engine.heads for m in h.modules())]:
        switch_off(module)
    return engine


def engine_with_source(args, rev: str) -> Engine:
    """The checkpoint loaded with the C kernels of git revision `rev`'s half_gemm.c."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:pipeline/model/half_gemm.c"],
                          capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "half_gemm.c"
        source.write_text(text)
        path = native.build(source=source)
        lib = native.load(path) if path else None
    if lib is None:
        raise SystemExit(f"{rev}'s half_gemm.c does not build or load here")
    with mock.patch.object(native, "library", lambda: lib):
        engine = Engine.from_pretrained(args.model, device=args.device)
    set_draft_vocab(engine, args.draft_vocab)
    return engine


def _torch_norm(module) -> None:
    if isinstance(module, RMSNorm):
        module.native = None


def _torch_layers(module) -> None:
    """Torch's attention, layers as modules, heads' forward and greedy drafting in Python."""
    if isinstance(module, DecoderLayer):
        module.native_layer = None
    if isinstance(module, Attention):
        module.native = None
    if isinstance(module, MTPHead):
        module.native_head = None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEMO)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 48])
    ap.add_argument("--ctx", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--q-max", type=int, default=6)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--draft-vocab", default="auto", help="auto (the checkpoint's), off, or a size N")
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="per-shape statistic over the repetitions (min: least disturbed, on a shared machine)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: the thread's CPU time (one torch thread on a shared CPU machine)")
    ap.add_argument("--compare", action="store_true", help="also time the baseline (see above), interleaved")
    ap.add_argument("--compare-gemm", action="store_true", help="also time float32 GEMMs (see above), interleaved")
    ap.add_argument("--compare-kernel", action="store_true",
                    help="also time FBGEMM's float16-weight GEMM in place of the native one (see above), interleaved")
    ap.add_argument("--compare-norm", action="store_true",
                    help="also time torch's RMSNorm in place of the C one (see above), interleaved")
    ap.add_argument("--compare-layer", action="store_true",
                    help="also time torch's attention and per-module layers in place of the C ones (see above)")
    ap.add_argument("--compare-source", metavar="REV",
                    help="also time the C kernels of git revision REV in place of the tree's (see above)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(args.model, device=args.device)
    set_draft_vocab(engine, args.draft_vocab)
    ids = getattr(engine.heads[0], "draft_ids", None) if engine.heads else None
    vd = "full" if ids is None else ids.numel()
    print(f"model: {args.model}  threads: {torch.get_num_threads()}  device: {engine.device}  draft vocab: {vd}  "
          f"{args.stat} of {args.reps}, {args.clock} clock\n")
    stat = min if args.stat == "min" else statistics.median
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if (args.compare or args.compare_gemm or args.compare_kernel or args.compare_norm or args.compare_layer
            or args.compare_source):
        if args.compare_source:
            engines = {f"C kernels at {args.compare_source}": engine_with_source(args, args.compare_source),
                       "C kernels of the tree": engine}
        elif args.compare_layer:
            engines = {"torch attention, module layers": engine_without(args, _torch_layers),
                       "C attention, C layers": engine}
        elif args.compare_norm:
            engines = {"torch RMSNorm": engine_without(args, _torch_norm), "C RMSNorm": engine}
        elif args.compare_kernel:
            with mock.patch("pipeline.model.packed.fp16_kernel", lambda: "fbgemm"):
                fbgemm = Engine.from_pretrained(args.model, device=args.device)
            set_draft_vocab(fbgemm, args.draft_vocab)
            engines = {"FBGEMM float16": fbgemm, "native float16": engine}
        elif args.compare_gemm:
            with mock.patch("pipeline.model.packed.fp16_gemm_works", lambda: False):
                plain = Engine.from_pretrained(args.model, device=args.device)
            set_draft_vocab(plain, args.draft_vocab)
            engines = {"float32 GEMM": plain, "float16-weight GEMM": engine}
        else:
            engines = {"baseline": baseline_engine(args.model, args.device), "lean": engine}
        results, names = [], []
        for r in args.rows:
            for c in args.ctx:
                got = measure_many(engines, r, c, q_max=args.q_max, reps=args.reps, stat=stat, clock=clock)
                results += list(got.values())
                names += list(got)
        print(table(results, names))
        return
    results = [measure(engine, r, c, q_max=args.q_max, reps=args.reps, stat=stat, clock=clock)
               for r in args.rows for c in args.ctx]
    print(table(results))


if __name__ == "__main__":
    main()
