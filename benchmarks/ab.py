"""Two versions of the engine in one process, alternating: is a change faster, and by how much?

On a shared machine the speed moves 15-30% between processes and minutes, more than most
changes are worth, so comparing two `+job=bench` runs measures the machine. Here version A (the
engine as loaded) and version B (A with one or more settings changed) run the same prompts in
turn, A B then B A, and each repetition's B/A ratio is read within that repetition.

    python benchmarks/ab.py --set target.fused_step=False --task complete --batch 1 --gammas 0 2 auto
    python benchmarks/ab.py --load-set pipeline.model.pages.HUGE_PAGES=False --task json --batch 1 32
    python benchmarks/ab.py --set pipeline.model.native.C_NOISE=False --temperature 0.7

`--set PATH=VALUE`: an attribute under the engine (`target.fused_step`, `verify_layout`) or
of a module (`pipeline.model.native.C_NOISE`), set for B's calls and put back after each. `--load-set MODULE.NAME=VALUE`: a module attribute read
while loading (2 MB pages, the C kernels' settings), so B loads a model of its own with it set.
Each version runs on an Engine of its own (own KV caches, cost tracker and policy state); with
only `--set`, both share one loaded model. Prints, per batch and gamma, decode tokens/s (target
prefill left out, as `+job=bench` does) of A and B, the paired B/A ratio, and whether B
generated exactly A's tokens. `--out` writes the same as JSON.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

from pipeline.bench.prompts import RANDOM, random_prompts, task_prompts  # noqa: E402
from pipeline.bench.repeat import paired, run_order, show_paired  # noqa: E402
from pipeline.bench.systems import run_engine  # noqa: E402
from pipeline.engine import Engine, SamplingParams  # noqa: E402

DEMO = ROOT / "pipeline" / "assets" / "demo"


def parse_setting(text: str) -> tuple[str, object]:
    """'a.b=VALUE' -> ('a.b', VALUE), VALUE a Python literal where it parses as one, else the
    string. Example: 'target.fused_step=False' -> ('target.fused_step', False)."""
    path, sep, raw = text.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"expected PATH=VALUE, got {text!r}")
    try:
        return path, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return path, raw


def _owner(root, path: str):
    """(object, attribute name) of a dotted path under `root`; a numeric part indexes."""
    *parts, name = path.split(".")
    for p in parts:
        root = root[int(p)] if p.isdigit() else getattr(root, p)
    if not hasattr(root, name):
        raise AttributeError(f"{path}: {type(root).__name__} has no attribute {name!r}")
    return root, name


def _module_owner(path: str):
    """(module, attribute name) of 'package.module.NAME'."""
    module, _, name = path.rpartition(".")
    obj = importlib.import_module(module)
    if not hasattr(obj, name):
        raise AttributeError(f"{path}: module {module} has no attribute {name!r}")
    return obj, name


@contextlib.contextmanager
def settings(root, changes: list[tuple[str, object]]):
    """Each change set on its attribute for the block, the old values put back after it: under
    `root` (an engine), or a module's where the path starts with `pipeline.` or root is None."""
    saved = []
    try:
        for path, value in changes:
            if root is None or path.startswith("pipeline."):
                obj, name = _module_owner(path)
            else:
                obj, name = _owner(root, path)
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)


def load_versions(model: str, device: str, batch: int, sets: list, load_sets: list) -> dict[str, Engine]:
    """{"A": engine as loaded, "B": its changed twin}. B shares A's weights unless it loads
    with `load_sets`."""
    a = Engine.from_pretrained(model, device=device, max_batch_size=batch)
    if load_sets:
        with settings(None, load_sets):
            b = Engine.from_pretrained(model, device=device, max_batch_size=batch)
    else:
        b = Engine(a.model, a.tokenizer, max_batch_size=batch, gamma_max=a.gamma_max)
    return {"A": a, "B": b}


def prompts_for(args, engine: Engine, n: int) -> list[list[int]]:
    if args.task == RANDOM:
        return random_prompts(n, engine.config.vocab_size, args.prompt_len, seed=0)
    return task_prompts(str(args.data), args.task, n, engine.tokenizer, args.long)


def compare(args) -> list[dict]:
    """One entry per (batch, gamma): each version's tokens/s per repetition and the paired ratio."""
    engines = load_versions(str(args.model), args.device, max(args.batch), args.set, args.load_set)
    params = SamplingParams(max_new_tokens=args.new, temperature=args.temperature, seed=0, ignore_eos=args.ignore_eos)
    out = []
    for batch in args.batch:
        prompts = prompts_for(args, engines["A"], max(batch, args.min_rows))
        for e in engines.values():
            e.max_batch_size = batch
        for gamma in args.gammas:
            g = gamma if gamma == "auto" else int(gamma)
            runs = {"A": [], "B": []}
            ids = {"A": [], "B": []}
            for rep in range(args.warmups + args.reps):
                for name in run_order(["A", "B"], rep):
                    with settings(engines[name], args.set if name == "B" else []):
                        m = run_engine(engines[name], prompts, params, g, draft=args.draft, task=args.task)
                    if rep >= args.warmups:
                        runs[name].append(m.tokens_per_s)
                        ids[name].append(m.token_ids)
            out.append({"batch": batch, "gamma": gamma, "tokens_per_s": runs,
                        "A": statistics.median(runs["A"]), "B": statistics.median(runs["B"]),
                        "B_over_A": paired(runs["B"], runs["A"]), "same_tokens": ids["A"] == ids["B"]})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| batch | gamma | A tokens/s | B tokens/s | B / A paired: median (min-max) | same tokens |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['gamma']} | {r['A']:.0f} | {r['B']:.0f} | {show_paired(r['B_over_A'])} | "
              f"{'yes' if r['same_tokens'] else '**no**'} |" for r in rows]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", type=parse_setting, action="append", default=[], metavar="PATH=VALUE",
                    help="an attribute under the engine, or a module's (pipeline....), changed for B (repeatable)")
    ap.add_argument("--load-set", type=parse_setting, action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="a module attribute set while B loads its own model (repeatable)")
    ap.add_argument("--model", type=Path, default=DEMO / "model")
    ap.add_argument("--data", type=Path, default=DEMO / "data" / "demo.parquet")
    ap.add_argument("--task", default="complete", help=f"a task of --data, or {RANDOM!r} (random token ids)")
    ap.add_argument("--prompt-len", type=int, default=32, help="a random prompt's length")
    ap.add_argument("--long", type=int, default=0, help="task prompts after other rows' texts up to this many tokens")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--gammas", nargs="+", default=["0", "2", "auto"], help="fixed gammas and/or auto")
    ap.add_argument("--draft", default="mtp", help="draft sources: mtp (the heads), auto, ngram, none")
    ap.add_argument("--min-rows", type=int, default=8, help="prompts per call at least (batch 1 runs them in turn)")
    ap.add_argument("--new", type=int, default=64, help="new tokens per row")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--warmups", type=int, default=1, help="untimed repetitions first")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    if not (args.set or args.load_set):
        ap.error("nothing to compare: give --set and/or --load-set")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = compare(args)
    changes = ", ".join(f"{p}={v!r}" for p, v in args.set + args.load_set)
    print(f"A: the engine as loaded; B: {changes}. {args.task}, {args.reps} repetitions, "
          f"{torch.get_num_threads()} torch threads.\n")
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps({"changes": changes, "task": args.task, "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
