"""Shared helpers for tests: tiny checkpoints and transformers references."""
from __future__ import annotations

import functools

import torch
import transformers

from pipeline.model.tiny import make_tiny_checkpoint


@functools.lru_cache(maxsize=None)
def tiny_checkpoint(root: str, **kwargs) -> str:
    """Write (once per test session and argument set) a tiny checkpoint under `root`."""
    name = "_".join(f"{k}-{v}" for k, v in sorted(kwargs.items()))
    return str(make_tiny_checkpoint(f"{root}/{name}", **kwargs))


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers generate(do_sample=False), one prompt at a time (no padding effects)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False)
            outs.append(ids[0, len(p):].tolist())
    return outs


def random_prompts(lengths, vocab_size: int, seed: int = 0, low: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(low, vocab_size, (n,), generator=gen).tolist() for n in lengths]
