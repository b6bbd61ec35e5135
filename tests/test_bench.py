"""The benchmark job: the matrix runs every system on the same prompts and the report states
ratios and targets from what was measured."""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.bench.report import break_even_batch, check_targets, write_all
from pipeline.bench.runner import BenchSpec, device_description, machine_info, run_matrix
from tests.tiny_models import tiny_checkpoint


def _cell(batch, **tps):
    return {"task": "complete", "temperature": 0.0, "prompt_length": "short", "batch": batch, "prompt_tokens": 10,
            "systems": {k.replace("g", "gamma=") if k.startswith("g") and k[1:].isdigit() else k:
                        {"tokens_per_s": v} for k, v in tps.items()}}


def test_break_even_and_targets_from_constructed_cells():
    cells = [_cell(1, transformers=100, g0=110, g2=250, auto=240),
             _cell(8, transformers=600, g0=700, g2=650, auto=690)]
    assert break_even_batch(cells) == 8
    targets = {t: (ok, ev) for t, ok, ev in check_targets(cells)}
    assert targets["auto >= 0.95 x best fixed gamma in every cell"][0] is True        # 240/250, 690/700
    assert targets["auto never below gamma 0"][0] is False                             # 690 < 700 at batch 8
    assert targets["gamma 0 >= transformers generate() at every batch size"][0] is True
    assert targets["auto >= 1.8 x transformers at batch 1 on complete"] == (True, "worst 2.40")
    # a cell where a system decoded nothing (every row ended at its first token) is left out
    empty = _cell(32, transformers=0.0, g0=0.0, g2=0.0, auto=0.0)
    assert check_targets(cells + [empty]) == check_targets(cells)


def test_quick_matrix_end_to_end(tmp_path):
    model = tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_mtp_layers=1, draftable=0.05)
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"task": ["complete"] * 4, "text": [f"def f{i}(a, b):\n    return a + b" for i in range(4)]}), data)
    spec = BenchSpec(model_path=model, data_path=str(data), out_dir=str(tmp_path / "out"), batches=(1, 2),
                     tasks=("complete",), temperatures=(0.0,), prompt_lengths=("short", "long"), long_prompt_tokens=40,
                     gammas=(0, 2), prompt_lookup_tokens=2, max_new_tokens=6, reps=1, device="cpu")
    result = run_matrix(spec, log=lambda *_: None)
    cells = result["cells"]
    assert len(cells) == 4
    for c in cells:
        expected = {"transformers", "gamma=0", "gamma=2", "auto"} | ({"prompt_lookup"} if c["batch"] == 1 else set())
        assert set(c["systems"]) == expected
        assert all(s["tokens_per_s"] > 0 for s in c["systems"].values())
        assert c["systems"]["gamma=0"]["roofline_fraction"] > 0
    long = [c for c in cells if c["prompt_length"] == "long"]
    assert all(c["prompt_tokens"] >= 40 for c in long)
    machine = machine_info(spec, result)
    assert machine["device"] == device_description(result["engine"]) and machine["max_new_tokens"] == 6
    text = write_all(result, tmp_path / "out", machine)
    assert "| target | met | evidence |" in text and "Break-even batch" in text
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert saved["cells"][0]["systems"]["gamma=0"]["tokens_per_s"] == cells[0]["systems"]["gamma=0"]["tokens_per_s"]
    assert (tmp_path / "out" / "bench_plots.html").stat().st_size > 100_000      # plotly.js inlined


def test_a_cell_of_more_prompts_than_its_batch_runs_transformers_at_that_batch(tmp_path, monkeypatch):
    """bench.min_rows puts 4 prompts in a batch-1 cell: the engine decodes them in turn, and so
    must transformers and its prompt lookup (which runs at batch 1 only)."""
    import pipeline.bench.runner as runner

    model = tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_mtp_layers=1, draftable=0.05)
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"task": ["complete"] * 4, "text": [f"def f{i}(a, b):\n    return a + b" for i in range(4)]}), data)
    seen, real = [], runner.run_transformers
    monkeypatch.setattr(runner, "run_transformers", lambda m, prompts, *a, **k: seen.append(len(prompts)) or real(m, prompts, *a, **k))
    spec = BenchSpec(model_path=model, data_path=str(data), out_dir=str(tmp_path / "out"), batches=(1,),
                     tasks=("complete",), temperatures=(0.0,), prompt_lengths=("short",), gammas=(0,),
                     prompt_lookup_tokens=2, max_new_tokens=4, reps=1, device="cpu", min_rows=4)
    cell = run_matrix(spec, log=lambda *_: None)["cells"][0]
    assert cell["rows"] == 4 and {"transformers", "prompt_lookup"} <= set(cell["systems"])
    assert seen and set(seen) == {1} and len(seen) == 1 + 2 * 4     # warm-up, then 4 prompts per system


def test_auto_runs_on_an_engine_of_its_own_unless_shared(tmp_path, monkeypatch):
    """bench.auto_engine: "own" puts auto's systems on a second engine, so the prices it reads
    come from its own steps only (as in a job), the fixed gammas' calls on the first; "shared"
    runs every system on one engine."""
    import pipeline.bench.runner as runner

    model = tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_mtp_layers=1, draftable=0.05)
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"task": ["complete"] * 2, "text": [f"def f{i}(a, b):" for i in range(2)]}), data)
    calls, real = [], runner.run_engine
    monkeypatch.setattr(runner, "run_engine", lambda e, p, pr, gamma, *a, **k:
                        calls.append((e, isinstance(gamma, int))) or real(e, p, pr, gamma, *a, **k))
    for mode in ("own", "shared"):
        calls.clear()
        spec = BenchSpec(model_path=model, data_path=str(data), out_dir=str(tmp_path / mode), batches=(1,),
                         tasks=("complete",), temperatures=(0.0,), prompt_lengths=("short",), gammas=(0, 2),
                         transformers=False, max_new_tokens=4, reps=2, device="cpu", auto_engine=mode)
        result = run_matrix(spec, log=lambda *_: None)
        fixed = {id(e) for e, is_fixed in calls if is_fixed}
        auto = {id(e) for e, is_fixed in calls if not is_fixed}
        assert len(calls) == 6 and len(fixed) == len(auto) == 1
        assert (fixed == auto) == (mode == "shared") and fixed == {id(result["engine"])}
        engines = {id(e): e for e, _ in calls}
        assert len({id(e.target) for e in engines.values()}) == 1           # one set of weights


def test_the_heads_prompt_fills_count_as_decoding_not_prefill(monkeypatch):
    """run_engine leaves the target's prefill out of decode time, and keeps the heads' fills of
    prompts (prefill records of no rows) in it, as drafting: plain decoding never pays them."""
    from types import SimpleNamespace

    import pipeline.bench.systems as systems
    from pipeline.spec_decode.stats import PrefillRecord, SpecStats

    stats = SpecStats()
    stats.observe_prefill(PrefillRecord(2, 20, 0.5))          # the target's prefill of two prompts
    stats.observe_prefill(PrefillRecord(0, 0, 0.2))           # the heads' fill of them, at the first draft
    out = SimpleNamespace(token_ids=[1, 2, 3])
    engine = SimpleNamespace(device="cpu", last_stats=stats, generate=lambda *a, **k: [out, out])
    clock = iter([10.0, 11.0])
    monkeypatch.setattr(systems.time, "perf_counter", lambda: next(clock))
    m = systems.run_engine(engine, [[1], [2]], None, 2)
    assert (m.prefill_s, m.decode_s, m.decode_tokens) == (0.5, 0.5, 4)
    assert m.draft_s == 0.2


def test_bench_quick_job_runs_through_hydra(tmp_path):
    import subprocess
    import sys

    model = tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_mtp_layers=1, draftable=0.05)
    data = tmp_path / "d.parquet"
    pq.write_table(pa.table({"task": ["complete"] * 2, "text": ["def f(a):\n    return a", "def g(b):\n    return b"]}), data)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "pipeline.run", "+job=bench_quick", f"model.path={model}",
                           f"data.path={data}", f"output.dir={out}", "model.device=cpu", "bench.batches=[1]",
                           "bench.gammas=[0,1]", "bench.max_new_tokens=4", "bench.prompt_lookup_tokens=0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "bench.md").exists() and "gamma=1" in (out / "bench.md").read_text()


def test_gamma_policy_benchmark_runs_every_system_with_its_control(tmp_path):
    """benchmarks/gamma_policy.py on the demo model at toy sizes: every fixed gamma, the gamma-0
    control and auto are timed on the same prompts, and the ratios come from those timings."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "gp.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "gamma_policy.py"), "--threads", "1",
                           "--new", "4", "--reps", "2", "--tasks", "json", "--batches", "1", "--min-prompts", "2",
                           "--gamma-max", "2", "--max-warmups", "1", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cell = json.loads(out.read_text())["cells"][0]
    runs = cell["tokens_per_s_per_rep"]
    assert set(runs) == {"0", "1", "2", "gamma=0 again", "auto"} and all(len(v) == 2 for v in runs.values())
    ratios = sorted(a / b for a, b in zip(runs["gamma=0 again"], runs["0"]))
    assert cell["paired_control_over_gamma0"] == {"median": sum(ratios) / 2, "min": ratios[0], "max": ratios[1]}
    assert cell["paired_auto_over_control"]["min"] == min(a / c for a, c in zip(runs["auto"], runs["gamma=0 again"]))
    best = max(("0", "1", "2"), key=lambda g: cell["tokens_per_s"][g])
    assert cell["best_fixed_gamma"] == int(best)
    assert sum(cell["auto_steps_per_gamma"].values()) == sum(c["steps"] for c in cell["auto_calls"])
    assert "| json | 1 |" in proc.stdout


def test_engine_speed_script_runs_the_matrix_on_random_prompts(tmp_path):
    """benchmarks/engine_speed.py is the matrix on random token ids, so it runs on a checkpoint
    without a tokenizer or dataset: one cell per batch, transformers and the fixed gammas only."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    model = tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_mtp_layers=1, draftable=0.05, with_tokenizer=False)
    out = tmp_path / "es"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "engine_speed.py"), "--model", model,
                           "--batches", "1", "2", "--gammas", "0", "2", "--new", "5", "--prompt-len", "7",
                           "--reps", "1", "--threads", "1", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cells = json.loads((out / "bench.json").read_text())["cells"]
    assert [(c["task"], c["batch"], c["prompt_tokens"]) for c in cells] == [("random", 1, 7), ("random", 2, 7)]
    for c in cells:
        assert set(c["systems"]) == {"transformers", "gamma=0", "gamma=2"}
    assert "| gamma=2 |" in proc.stdout


def test_cost_fit_script_prices_every_profiled_forward(tmp_path):
    """benchmarks/cost_fit.py: one table row per profiled (rows, context), every q in it, and
    the relative error over all of them."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    model = tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "cost_fit.py"), "--model", model,
                           "--rows", "4", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, cwd=root,
                          env={**os.environ, "SPECBATCH_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "q1 " in line]
    assert len(rows) == 4                                   # rows 1 and 4, two contexts each
    assert all("q6 " in line for line in rows)              # gamma_max 5: q up to 6
    assert "relative error over 24 forwards" in proc.stdout


def test_mixed_context_script_times_each_layout_of_contexts(tmp_path):
    """benchmarks/mixed_context.py: one row per (tokens, long context), each with the three
    layouts timed and the mean context of the mixed one."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    model = tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "mixed_context.py"), "--model", model,
                           "--rows", "4", "--short", "8", "--long", "16", "32", "--tokens", "1", "2", "--reps", "1"],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [(r[0].strip(), r[1].strip()) for r in rows[1:]] == [("1", "16"), ("1", "32"), ("2", "16"), ("2", "32")]
    assert all(float(x) > 0 for r in rows[1:] for x in r[2:5])
    assert [r[5].strip() for r in rows[1:]] == ["10", "14", "10", "14"]       # (3 x 8 + long) / 4


def test_run_order_alternates_and_paired_ratios_are_per_repetition():
    from pipeline.bench.repeat import paired, run_order, show_paired

    assert run_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert run_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    r = paired([2.0, 3.0, 8.0], [1.0, 2.0, 4.0])
    assert r == {"median": 2.0, "min": 1.5, "max": 2.0}
    assert show_paired(r) == "2.00 (1.50-2.00)"


def test_cold_start_script_times_a_fresh_engine_against_fixed_gammas(tmp_path):
    """benchmarks/cold_start.py at toy sizes: a fresh engine per rep (no cached profile with
    --no-cache), its first auto call reported with its calibration steps, then each system's row."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "cold_start.py"), "--prompts", "2",
                           "--reps", "1", "--max-new-tokens", "4", "--gammas", "0,1", "--no-cache",
                           "--transformers", "--fresh-gammas", "1"],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rep 0: fresh auto" in proc.stdout and "profiles 0" in proc.stdout     # no profile: explored
    for row in ("| auto (fresh engine, first call) |", "| auto (warm engine) |", "| gamma=0 |", "| gamma=1 |",
                "| transformers generate() |", "fresh auto vs transformers generate()",
                "| gamma=1 (fresh engine, first call) |", "fresh auto vs gamma=1 (fresh engine, first call)"):
        assert row in proc.stdout, proc.stdout


def test_gamma_policy_calls_draft_with_the_heads_alone(tmp_path, monkeypatch):
    """The gamma-policy benchmark repeats the same prompts; with n-grams on, auto would draft
    each answer from the previous call's copy of it. Every call it makes is draft="mtp", and its
    auto policies name the cell's task (as a run's plan does: that task's shipped prior)."""
    from pipeline.bench import gamma_policy as gp
    from pipeline.engine import Engine, SamplingParams
    from tests.tiny_models import random_prompts

    seen = []
    real = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, *a, **k: seen.append(k.get("draft")) or real(self, *a, **k))
    tasks, real_policy = [], Engine.auto_policy
    monkeypatch.setattr(Engine, "auto_policy", lambda self, *a, **k: tasks.append(k.get("task")) or real_policy(self, *a, **k))
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=2, gamma_max=2)
    prompts = random_prompts([4, 6], 128, seed=1)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    spec = gp.GammaPolicySpec(model_path=str(path), data_path="", max_warmups=1)
    cell = gp.Cell("t", 2, prompts, gp.warm_up(engine, spec, "t", prompts, params))
    for system in ("auto", 1, gp.CONTROL):
        gp.time_call(engine, cell, system, params)
    assert seen and set(seen) == {"mtp"}
    assert len(tasks) == 2 and set(tasks) == {"t"}            # the warm-up's policy and the timed auto's


def test_transformers_decode_time_is_its_own_step_stamps(tmp_path, monkeypatch):
    """run_transformers times decode inside the one generate call it makes (first step's end to
    the last one's), on a clock that moves 1 s a reading: a separately timed prefill no longer
    enters the decode time, and the tokens counted are those after each row's first."""
    import itertools

    import transformers

    from pipeline.bench import systems
    from pipeline.engine.params import SamplingParams
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint(str(tmp_path / "m"), arch="llama")).eval()
    ticks = itertools.count()
    monkeypatch.setattr(systems.time, "perf_counter", lambda: float(next(ticks)))
    calls, real = [], model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    m = systems.run_transformers(model, [[3, 4, 5], [6, 7]], params, pad_id=0, eos_ids=())
    assert len(calls) == 1
    assert m.decode_tokens == 2 * 4                 # 5 new tokens a row, the first from prefill
    assert m.decode_s == 4.0 and m.token_latency_s == [1.0] * 4      # 5 stamps, one reading each
    assert m.prefill_s == 1.0                       # t0, then the first stamp


def test_summarized_cells_pair_each_policy_system_with_gamma_0_and_the_best_fixed_gamma(tmp_path):
    """summarize_cell divides auto's and draft=...'s tokens/s by gamma 0's and the best fixed
    gamma's repetition by repetition; the best is the fixed gamma with the highest median, a
    repetition with nothing decoded leaves a pair out, and bench.md shows the pairs."""
    from pipeline.bench.report import paired_lines
    from pipeline.bench.runner import Cell, summarize_cell
    from pipeline.bench.systems import Measurement

    def runs(*tps):
        return [Measurement(decode_tokens=int(t), decode_s=1.0, prefill_s=0.0) for t in tps]

    cell = Cell("json", 0.0, "short", 1, [[1, 2]])
    cell.results = {"gamma=0": runs(100, 80, 120), "gamma=2": runs(150, 90, 200), "gamma=4": runs(10, 300, 10),
                    "auto": runs(150, 100, 150), "draft=ngram": runs(50, 0, 60), "transformers": runs(40, 40, 40)}
    out = summarize_cell(cell)["paired"]
    assert set(out) == {"auto", "draft=ngram"}
    assert out["auto"]["gamma=0"] == {"median": 1.25, "min": 1.25, "max": 1.5}             # 150/100, 100/80, 150/120
    assert out["auto"]["gamma=2"] == {"median": 1.0, "min": 0.75, "max": 10 / 9}           # median 150 beats 10 and 100
    assert out["draft=ngram"] == {}                                                         # its second rep decoded nothing
    text = "\n".join(paired_lines([summarize_cell(cell)]))
    assert "| json T=0.0 short b=1 | auto | 1.25 (1.25-1.50) | 1.00 (0.75-1.11) (gamma=2) |" in text


def _load_script(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ab_script_alternates_two_versions_and_puts_each_setting_back(tmp_path):
    """benchmarks/ab.py: B runs with its settings and A without, in alternating order, on engines
    of their own; every repetition is paired; the tokens are compared; an attribute set for B's
    calls is back to A's value after each, and a module attribute set for B's load likewise."""
    from pipeline.bench.repeat import paired
    from pipeline.model import pages

    ab = _load_script("ab")
    huge = pages.HUGE_PAGES
    model = tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_mtp_layers=1, draftable=0.05, with_tokenizer=False)
    seen = []
    real = ab.run_engine

    def spy(engine, prompts, params, gamma, **kw):
        seen.append((engine.target.fused_step, engine.verify_layout, gamma))
        return real(engine, prompts, params, gamma, **kw)

    ab.run_engine = spy
    out = tmp_path / "ab.json"
    rows = ab.main(["--model", str(model), "--task", "random", "--prompt-len", "6", "--batch", "1", "2",
                    "--gammas", "0", "auto", "--new", "4", "--reps", "2", "--warmups", "0", "--min-rows", "2",
                    "--device", "cpu", "--set", "verify_layout='packed'", "--load-set",
                    "pipeline.model.pages.HUGE_PAGES=False", "--out", str(out)])
    assert [(r["batch"], r["gamma"]) for r in rows] == [(1, "0"), (1, "auto"), (2, "0"), (2, "auto")]
    for r in rows:
        assert len(r["tokens_per_s"]["A"]) == len(r["tokens_per_s"]["B"]) == 2
        assert r["B_over_A"] == paired(r["tokens_per_s"]["B"], r["tokens_per_s"]["A"])
        assert r["same_tokens"] is True                       # greedy: a verify layout changes no token
    layouts = [layout for _, layout, _ in seen]
    assert layouts[:4] == ["auto", "packed", "packed", "auto"]     # A B, then B A
    assert pages.HUGE_PAGES is huge
    assert json.loads(out.read_text())["rows"][0]["gamma"] == "0"
    ab.run_engine = real
    import pytest
    with pytest.raises(AttributeError):
        with ab.settings(object(), [("no_such_flag", 1)]):
            pass
