"""Shared helpers for tests: tiny checkpoints and transformers references."""
from __future__ import annotations

import functools
import os
import tempfile
from contextlib import contextmanager

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


def heads_always_at(engine, gamma: int):
    """An auto policy (so the n-gram tails are on) whose heads draft `gamma` every step."""
    from pipeline.spec_decode.policy import GoodputPolicy

    base = engine.auto_policy()

    class HeadsAt(GoodputPolicy):
        def choose(self, ctx):
            return gamma

    return HeadsAt(base.gamma_max, base.cost)


def keep_every_tail(monkeypatch) -> list[list[int]]:
    """Every heads row keeps all of its n-gram tail, whatever the price; returns the tails kept
    per step (pipeline.engine.drafting.DraftPlanner._add_tails)."""
    import pipeline.engine.drafting as drafting
    from pipeline.spec_decode.row_drafts import leading

    kept = []

    def every(p_tail, width, gamma, base, costs):
        kept.append([leading(t) for t in p_tail])
        return kept[-1]

    monkeypatch.setattr(drafting, "tail_lengths", every)
    return kept


def flat_forwards(key: str) -> float:
    """A made-up machine's prices (a VirtualClock rule): a target or head forward 5 ms + 20 us a
    token, anything else 10 us a row: the batch-1 regime where a drafted token is nearly free."""
    from pipeline.bench.virtual_clock import _work
    (kind, _, _), (rows, q, _) = _work(key)
    return 5e-3 + 2e-5 * rows * q if kind in ("target", "head") else 1e-5 * rows


@contextmanager
def made_up_machine():
    """Engines built and run inside see `flat_forwards`' prices, not this machine's timing, with a
    profile cache of their own. For tests that assert what `auto` decides: on a busy CI machine
    the tiny models' real timings once priced every draft out (host time stays real, and is
    small beside 5 ms forwards)."""
    from pipeline.bench.virtual_clock import VirtualClock
    before = os.environ.get("SPECBATCH_CACHE")
    try:
        with tempfile.TemporaryDirectory(prefix="made-up-machine-") as cache:
            os.environ["SPECBATCH_CACHE"] = cache
            with VirtualClock(rule=flat_forwards).installed() as clock:
                yield clock
    finally:
        if before is None:
            os.environ.pop("SPECBATCH_CACHE", None)
        else:
            os.environ["SPECBATCH_CACHE"] = before
