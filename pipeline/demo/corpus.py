"""Training examples and the shipped evaluation dataset, from extracted functions.

Training uses only functions outside the held-out split; the shipped dataset (`demo.parquet`)
uses only held-out functions. Columns: id, task, text, reference, prompt, module, qualname.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from pipeline.demo.extract import FunctionRecord, pydoc_topics
from pipeline.demo.tasks import TASKS, prompt_for, task_pairs, training_texts


@dataclass
class Example:
    ids: list[int]           # [bos, prompt..., answer..., eos]
    answer_start: int        # index of the first answer token (1 for raw text)
    task: str = "raw"        # "raw" | "summarize" | "json"


def tokenized_examples(records: list[FunctionRecord], tokenizer, max_len: int,
                       with_topics: bool = True) -> list[Example]:
    """Encode every training (prompt, answer) pair; over-long examples are dropped. Prompt and
    answer are encoded separately, exactly as a prompt is encoded at generation time."""
    from pipeline.demo.tokenizer import BOS_ID, EOS_ID, encode_plain

    pairs = [p for r in records if not r.heldout for p in training_texts(r)]
    if with_topics:
        for topic in pydoc_topics():
            for chunk in _chunks(topic, 1500):
                pairs.append(("raw", "", chunk))
    out = []
    for task, prompt, answer in pairs:
        p = encode_plain(tokenizer, prompt) if prompt else []
        ids = [BOS_ID] + p + encode_plain(tokenizer, answer) + [EOS_ID]
        if len(ids) <= max_len:
            out.append(Example(ids, 1 + len(p), task))
    return out


def _chunks(text: str, size: int) -> list[str]:
    """Split text at paragraph breaks into pieces of about `size` characters."""
    out, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) > size:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    if cur:
        out.append(cur)
    return [c[: 2 * size] for c in out]


def tokenizer_texts(records: list[FunctionRecord]) -> list[str]:
    """Texts the tokenizer is trained on: the training split's sources, prompts and topics."""
    texts = []
    for r in records:
        if not r.heldout:
            texts.extend(p + a for _, p, a in training_texts(r))
    return texts + pydoc_topics()


def demo_rows(records: list[FunctionRecord], seed: int = 0) -> list[dict]:
    """Rows of the shipped dataset from held-out functions, grouped by task, ids 0..N-1."""
    held = [r for r in records if r.heldout]
    rows = []
    for task in TASKS:
        group = [(r, text, ref) for r in held for t, text, ref in task_pairs(r) if t == task]
        random.Random(f"{seed}-{task}").shuffle(group)
        for r, text, ref in group:
            rows.append(dict(task=task, text=text, reference=ref.strip() if task != "complete" else ref,
                             prompt=prompt_for(task, text), module=r.module, qualname=r.qualname))
    for i, row in enumerate(rows):
        row["id"] = i
    return rows


def write_demo_parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = ["id", "task", "text", "reference", "prompt", "module", "qualname"]
    table = pa.table({c: [r[c] for r in rows] for c in cols})
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, str(path), compression="zstd")
    return path
