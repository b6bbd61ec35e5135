"""What coupled verification costs against rejection: acceptance per task and temperature on the
demo model, the host cost of the noise, and tokens/s at one batch size.

    python benchmarks/coupled_acceptance.py --threads 1                 # all three parts
    python benchmarks/coupled_acceptance.py --parts noise --threads 1   # the noise cost only

acceptance: pipeline.demo.evaluate.evaluate_acceptance at a fixed gamma for each (temperature,
rule, seed); a_k pooled over seeds (counts), mean acceptance length likewise.
noise: per verify step at --rows rows, gamma --gamma and the model's vocabulary: the coupled
rule's sampling work (noise for gamma + 1 positions, drafts and target picked from it) against
the rejection rule's (draft and target probabilities, uniforms, the accept/residual rule); the
minimum over repetitions.
speed: tokens/s of one task at --rows rows, gamma 0 and --gamma, both rules, interleaved, medians.
Prints markdown tables (the rows of benchmarks/RESULTS.md).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # run as a script from anywhere

import torch  # noqa: E402

from pipeline.demo.evaluate import evaluate_acceptance, load_rows  # noqa: E402
from pipeline.demo.tasks import TASKS  # noqa: E402
from pipeline.spec_decode import rng  # noqa: E402
from pipeline.spec_decode.acceptance import coupled_accept, rejection_sample  # noqa: E402
from pipeline.spec_decode.sampling import coupled_sample, filtered_probs, sample, sparse_coupled_sample  # noqa: E402

DEMO = ROOT / "pipeline" / "assets" / "demo"
RULES = ("coupled", "rejection")


def acceptance_table(args) -> str:
    pooled = {}                                    # (task, T, rule) -> [reached, accepted, steps, emitted]
    for temperature in args.temperatures:
        for seed in args.seeds:
            for rule in RULES:
                res = evaluate_acceptance(args.model, args.data, gamma=args.gamma, rows_per_task=args.rows_per_task,
                                          max_new_tokens=args.new, examples=0, log=lambda *_: None,
                                          temperature=temperature, verify=rule, seed=seed)
                for task, r in res.items():
                    acc = pooled.setdefault((task, temperature, rule), [[0] * args.gamma, [0] * args.gamma, 0.0, 0.0])
                    for k in range(args.gamma):
                        acc[0][k] += r["reached"][k]
                        acc[1][k] += r["accepted"][k]
                    steps = r["reached"][0]               # every step reaches depth 1 at a fixed gamma
                    acc[2] += steps
                    acc[3] += steps * r["mean_acceptance_length"]
                print(f"T={temperature} seed={seed} {rule}: done", file=sys.stderr, flush=True)
    head = "| task | T | mean acceptance length (coupled / rejection) | " + " | ".join(
        f"a_{k + 1} (c / r)" for k in range(args.gamma)) + " | row-steps (c / r) |"
    lines = [head, "|" + "---|" * (args.gamma + 4)]
    for task in TASKS:
        for temperature in args.temperatures:
            c, r = pooled[task, temperature, "coupled"], pooled[task, temperature, "rejection"]
            cells = [f"{c[3] / max(c[2], 1):.3f} / {r[3] / max(r[2], 1):.3f}"]
            cells += [f"{c[1][k] / max(c[0][k], 1):.3f} / {r[1][k] / max(r[0][k], 1):.3f}" for k in range(args.gamma)]
            cells.append(f"{int(c[2])} / {int(r[2])}")
            lines.append(f"| {task} | {temperature} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def noise_table(args, vocab: int) -> str:
    n, g, reps = args.rows, args.gamma, args.reps * 5
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(n, g + 1, vocab, generator=gen) * 3          # [n, g + 1, V]
    draft_logits = torch.randn(n, g, vocab, generator=gen) * 3               # [n, g, V]
    keys = torch.arange(n)
    pos = torch.randint(16, 256, (n, 1), generator=gen) + torch.arange(g + 1)   # [n, g + 1]
    drafts = torch.randint(0, vocab, (n, g), generator=gen)
    T = 0.7

    def noise_only():
        rng.exponential_noise(0, keys, pos, vocab)

    def coupled_step(top_k=0):
        def step():
            q, p = filtered_probs(draft_logits, T, top_k), filtered_probs(target_logits, T, top_k)
            d = sparse_coupled_sample(q, 0, keys, pos[:, :g]) if top_k else None      # as CoupledSampler
            if d is None:                                                     # drafts' noise reused
                noise = rng.exponential_noise(0, keys, pos, vocab)
                d, t = coupled_sample(q, noise[:, :g]), coupled_sample(p, noise)
            else:
                t = sparse_coupled_sample(p, 0, keys, pos)
            coupled_accept(d, t)
        return step

    def rejection_step(top_k=0):
        def step():
            q = filtered_probs(draft_logits, T, top_k)
            sample(q, rng.uniforms(0, keys, pos[:, :g], rng.DRAFT))
            p = filtered_probs(target_logits, T, top_k)
            rejection_sample(drafts, q, p, rng.uniforms(0, keys, pos[:, :g], rng.ACCEPT),
                             rng.uniforms(0, keys, pos, rng.TARGET))
        return step

    def plain(rule):
        p1 = target_logits[:, :1]
        if rule == "coupled":
            return lambda: coupled_sample(filtered_probs(p1, T), rng.exponential_noise(0, keys, pos[:, :1], vocab))
        return lambda: sample(filtered_probs(p1, T), rng.uniforms(0, keys, pos[:, :1], rng.TARGET))

    rows = [("noise alone, gamma + 1 positions", noise_only), ("coupled, whole step", coupled_step()),
            ("rejection, whole step", rejection_step()), ("coupled, gamma 0 step", plain("coupled")),
            ("rejection, gamma 0 step", plain("rejection")), ("coupled, whole step, top_k 50", coupled_step(50)),
            ("rejection, whole step, top_k 50", rejection_step(50))]
    lines = [f"| per-step sampling work ({n} rows, gamma {g}, V={vocab}, T={T}) | ms (min of {reps}, interleaved) |",
             "|---|---|"]
    best = {name: float("inf") for name, _ in rows}
    for _ in range(reps):                              # interleaved: a busy spell hits every row alike
        for name, fn in rows:
            best[name] = min(best[name], _best(fn, 1))
    lines += [f"| {name} | {ms:.2f} |" for name, ms in best.items()]
    return "\n".join(lines)


def speed_table(args) -> str:
    from pipeline.engine import Engine, SamplingParams

    engine = Engine.from_pretrained(str(args.model), device="cpu", dtype="float32", max_batch_size=args.rows)
    prompts = [r["prompt"] for r in load_rows(args.data, args.speed_task, args.rows)]
    cells = {(g, rule): [] for g in (0, args.gamma) for rule in RULES}
    for _ in range(args.reps):
        for (g, rule), times in cells.items():
            params = SamplingParams(max_new_tokens=args.new, temperature=0.7, verify=rule, ignore_eos=True)
            t = time.perf_counter()
            outs = engine.generate(prompts, params, gamma=g)
            times.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    lines = [f"| {args.speed_task}, {args.rows} rows, T=0.7, {args.new} tokens | coupled tok/s | rejection tok/s | coupled / rejection |",
             "|---|---|---|---|"]
    for g in (0, args.gamma):
        c, r = statistics.median(cells[g, "coupled"]), statistics.median(cells[g, "rejection"])
        lines.append(f"| gamma {g} | {c:.0f} | {r:.0f} | {c / r:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEMO / "model")
    ap.add_argument("--data", type=Path, default=DEMO / "data" / "demo.parquet")
    ap.add_argument("--parts", nargs="+", default=["acceptance", "noise", "speed"])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--rows-per-task", type=int, default=128)
    ap.add_argument("--new", type=int, default=64, help="max new tokens per row")
    ap.add_argument("--rows", type=int, default=48, help="rows per step for the noise and speed parts")
    ap.add_argument("--speed-task", default="json", choices=TASKS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    if "acceptance" in args.parts:
        print(f"\nAcceptance at gamma {args.gamma}, {args.rows_per_task} rows per task, seeds {args.seeds}:\n")
        print(acceptance_table(args), flush=True)
    if "noise" in args.parts:
        import json
        vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
        print("\n" + noise_table(args, vocab), flush=True)
    if "speed" in args.parts:
        print("\n" + speed_table(args), flush=True)


if __name__ == "__main__":
    main()
