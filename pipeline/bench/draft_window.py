"""The MTP heads' prompt window measured (pipeline.model.draft_window): per task, with the data's
prompts and with long ones, each window's tokens per drafted step, the heads' fill a prompt and
decode tokens/s, the text checked against the whole prompt's. Used by
`benchmarks/draft_window.py` and the demo build's `window` stage."""
from __future__ import annotations

from pipeline.bench.prompts import column_prompts, task_prompts
from pipeline.bench.systems import run_engine
from pipeline.engine import Engine, SamplingParams


def measure(engine: Engine, prompts: list, window: int, gamma: int, batch: int, new: int, task: str) -> dict:
    """One window over `prompts`, `batch` at a time, greedy at `gamma`: tokens per drafted
    row-step, the heads' prompt fill ms a prompt, and decode tokens/s as `+job=bench` counts
    them (systems.run_engine: the target's prefill and each row's first token left out)."""
    engine.draft_window = window
    params = SamplingParams(max_new_tokens=new, temperature=0.0)
    tokens, rows, emitted, fill_s, decode_s, texts = 0, 0, 0, 0.0, 0.0, []
    for i in range(0, len(prompts), batch):
        m = run_engine(engine, prompts[i:i + batch], params, gamma, task=task)
        st = engine.last_stats
        drafted = [s for s in st.steps if s.gamma > 0]
        emitted += sum(s.emitted for s in drafted)
        rows += sum(s.rows for s in drafted)
        fill_s += sum(p.seconds for p in st.prefills if not p.rows)
        decode_s += m.decode_s
        tokens += m.decode_tokens
        texts += m.token_ids
    return {"tokens_per_step": emitted / max(rows, 1), "fill_ms": 1e3 * fill_s / len(prompts),
            "tokens_per_s": tokens / max(decode_s, 1e-9), "texts": texts}


def measure_windows(engine: Engine, data_path: str, tasks, windows, gamma: int = 3, prompts: int = 24,
                    batch: int = 8, long_tokens: int = 384, new: int = 64, column: str | None = None) -> dict:
    """"task/data" and "task/long" -> window -> measure()'s numbers (texts dropped), plus
    "prompt_tokens". Prompts: the demo tasks' rows in their formats, or with `column` that
    column's values as they are (one task, `column`). Raises AssertionError where a window
    changes the text. The engine's own window is put back after."""
    kept = engine.draft_window
    windows = sorted(set(windows) | {0})
    lengths = {"data": 0, "long": long_tokens} if long_tokens else {"data": 0}
    cells = {}
    try:
        for task in ([column] if column else tasks):
            for name, length in lengths.items():
                ps = (column_prompts(str(data_path), column, prompts, engine.tokenizer, length) if column
                      else task_prompts(str(data_path), task, prompts, engine.tokenizer, length))
                measure(engine, ps[:batch], 0, gamma, batch, new, task)                  # warm-up
                got = {w: measure(engine, ps, w, gamma, batch, new, task) for w in windows}
                for w in windows:
                    assert got[w]["texts"] == got[0]["texts"], f"window {w} changed the text ({task}, {name})"
                cell = {w: {k: v for k, v in m.items() if k != "texts"} for w, m in got.items()}
                cell["prompt_tokens"] = sum(map(len, ps)) / len(ps)
                cells[f"{task}/{name}"] = cell
    finally:
        engine.draft_window = kept
    return cells


def tokens_per_step(cells: dict, windows) -> dict[int, dict[str, float]]:
    """window -> cell -> tokens per step: choose_window's input."""
    return {w: {c: by_w[w]["tokens_per_step"] for c, by_w in cells.items()} for w in sorted(set(windows) | {0})}


def markdown(cells: dict, windows) -> str:
    windows = sorted(set(windows) | {0})
    lines = ["| task/prompts | prompt tokens | " + " | ".join(f"W={w or 'all'}" for w in windows) + " |",
             "|---|---:|" + "---|" * len(windows)]
    for c, by_w in cells.items():
        row = " | ".join(f"{by_w[w]['tokens_per_step']:.2f} / {by_w[w]['fill_ms']:.2f} ms / {by_w[w]['tokens_per_s']:.0f}"
                         for w in windows)
        lines.append(f"| {c} | {by_w['prompt_tokens']:.0f} | {row} |")
    lines.append("\n(cells: tokens per drafted step / the heads' fill a prompt / decode tokens/s)")
    return "\n".join(lines)
