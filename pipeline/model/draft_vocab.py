"""A draft vocabulary: the frequent-token subset of the vocabulary an MTP head drafts over.

A draft depth pays the output projection over every token (6,144 x 256 on the demo model, half
the depth's cost; 128k x hidden on production heads). Drafting over the Vd most frequent tokens
of the heads' training corpus pays Vd / V of it. Lossless by construction: drafts are tokens of
the full vocabulary and the target verifies over all of it, so greedy output is unchanged; for
rejection sampling the draft distribution q is zero outside the subset (`full_vocab_probs`),
which min(1, p / q) and the residual max(0, p - q) handle like any q. What is lost is only
acceptance where the target's token falls outside the subset (`coverage` says how often).

Stored with the heads as `draft_vocab.json` in the checkpoint directory:
{"ids": [sorted token ids], "source": "...", "coverage": share of corpus tokens inside}.
A checkpoint without the file drafts over the full vocabulary.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

FILE = "draft_vocab.json"


def count_tokens(sequences: Iterable, vocab_size: int) -> torch.Tensor:
    """Occurrences of each token id over sequences of ids (lists or 1-d tensors). [V] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        ids = torch.as_tensor(seq, dtype=torch.long).reshape(-1)
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def top_tokens(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids (ties: lower id first), `always` included (EOS must
    stay draftable, or a row ending early never accepts its end). Sorted ascending, [size].
    Example: counts [5, 0, 9, 1], size 2, always [3] -> [2, 3]."""
    always = sorted({int(t) for t in always})
    if size < len(always) or size > counts.numel():
        raise ValueError(f"draft vocabulary size {size} must lie in [{len(always)}, {counts.numel()}]")
    score = counts.double().clone()
    score[always] = float("inf")
    order = torch.sort(-score, stable=True).indices                    # most frequent first
    return torch.sort(order[:size]).values


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """Share of counted tokens inside the subset."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


def save_draft_vocab(checkpoint_dir, ids: torch.Tensor, source: str, counts: torch.Tensor | None = None) -> Path:
    path = Path(checkpoint_dir) / FILE
    info = {"ids": [int(i) for i in ids], "source": source}
    if counts is not None:
        info["coverage"] = round(coverage(counts, ids), 6)
    path.write_text(json.dumps(info))
    return path


def load_draft_vocab(checkpoint_dir, vocab_size: int) -> torch.Tensor | None:
    """The stored subset [Vd] (sorted, unique, in range), or None where the checkpoint has none."""
    path = Path(checkpoint_dir) / FILE
    if not path.is_file():
        return None
    ids = torch.tensor(json.loads(path.read_text())["ids"], dtype=torch.long)
    if ids.numel() == 0 or not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"{path}: ids must be sorted, unique and in [0, {vocab_size})")
    return ids


def choose_draft_vocab(sequences: Iterable, vocab_size: int, size: int,
                       always: Iterable[int] = ()) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(the top `size` tokens of `sequences`, `always` included, or None where size is 0 or
    covers the whole vocabulary; the token counts). Heads train over it and store it."""
    counts = count_tokens(sequences, vocab_size)
    if size <= 0 or size >= vocab_size:
        return None, counts
    return top_tokens(counts, size, always), counts


def build_draft_vocab(checkpoint_dir, sequences: Iterable, size: int, source: str,
                      always: Iterable[int] = ()) -> Path | None:
    """Count `sequences` (the heads' corpus), keep the top `size` tokens (and `always`, e.g. EOS)
    and store them with the heads. size 0, or one that covers the whole vocabulary, stores none
    (and removes a stale file: new heads must not draft over an old corpus's subset)."""
    root = Path(checkpoint_dir)
    vocab_size = json.loads((root / "config.json").read_text())["vocab_size"]
    (root / FILE).unlink(missing_ok=True)
    ids, counts = choose_draft_vocab(sequences, vocab_size, size, always)
    return None if ids is None else save_draft_vocab(root, ids, source, counts)


def full_vocab_probs(probs: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """probs [n, Vd] over the subset -> [n, V], zero outside it."""
    full = probs.new_zeros(probs.shape[0], vocab_size)
    full[:, ids] = probs
    return full


def full_vocab_logits(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """logits [n, Vd] over the subset -> [n, V], -inf outside it: for a pick that must see
    full-vocabulary columns (noise keyed by token id, as a coupled rule draws it)."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    full[:, ids] = logits
    return full


def to_full_vocab(tokens: torch.Tensor, probs: torch.Tensor | None, ids: torch.Tensor | None, vocab_size: int):
    """A draft picked over the subset, as full-vocabulary ids (and q scattered to [n, V])."""
    if ids is None:
        return tokens, probs
    return ids[tokens], None if probs is None else full_vocab_probs(probs, ids, vocab_size)
