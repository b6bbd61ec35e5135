"""Benchmark prompts: a demo task's rows in its prompt format, or random token ids (for a
checkpoint without a tokenizer or a dataset)."""
from __future__ import annotations

import pyarrow.parquet as pq
import torch

from pipeline.demo.tasks import TEMPLATES      # the demo tasks' prompt formats

RANDOM = "random"        # the task name of random token-id prompts


def task_texts(data_path: str, task: str) -> list[str]:
    """The `text` column of the dataset's rows of `task`."""
    rows = pq.read_table(data_path, columns=["task", "text"]).to_pylist()
    return [r["text"] for r in rows if r["task"] == task]


def task_prompts(data_path: str, task: str, n: int, tokenizer=None, long_tokens: int = 0) -> list:
    """n prompts of `task` (rows reused in turn when there are fewer), as strings, or as token ids
    when `tokenizer` is given. long_tokens > 0: other rows' texts go before each prompt as context
    until it is at least that many tokens (needs `tokenizer`)."""
    return _prompts(task_texts(data_path, task), TEMPLATES[task], n, tokenizer, long_tokens)


def column_prompts(data_path: str, column: str, n: int, tokenizer=None, long_tokens: int = 0) -> list:
    """task_prompts for any Parquet file: the first rows' non-null values of `column`, used as
    they are (no template)."""
    texts = [t for t in pq.read_table(data_path, columns=[column]).column(column).to_pylist() if t]
    if not texts:
        raise ValueError(f"{data_path}: no text in column {column!r}")
    return _prompts(texts[:max(n, 1) * 2], "{text}", n, tokenizer, long_tokens)


def _prompts(texts: list[str], template: str, n: int, tokenizer, long_tokens: int) -> list:
    out = []
    for i in range(n):
        prompt = template.format(text=texts[i % len(texts)])
        if long_tokens:
            context, j = [], i + 1
            while len(tokenizer("\n\n".join(context + [prompt]))["input_ids"]) < long_tokens:
                context.append(texts[j % len(texts)])
                j += 1
            prompt = "\n\n".join(context + [prompt])
        out.append(tokenizer(prompt)["input_ids"] if tokenizer is not None else prompt)
    return out


def random_prompts(n: int, vocab_size: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` token ids drawn uniformly from 3..vocab_size-1 (ids 0-2 are often
    special), the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (length,), generator=gen).tolist() for _ in range(n)]
