"""The systems under test, each measured the same way: decode only.

Decode time excludes prefill (reported apart): for the engine, the generate wall time less its
prefill records; for transformers, the time from its first decode step's end (prefill plus the
first token) to its last one's, stamped by a stopping criterion in the same call. Decode tokens
are the generated tokens after those of the first step (each row's first token, which comes from
prefill in both). Subtracting a separately timed prefill instead read 320-4,600 tok/s for one
summarize batch-32 call whose decode was 1 s beside a 1.5 s prefill (docs/decisions.md,
2026-12-05). Per-token latency is the time per decode step divided by the tokens one row gets
from that step (1 for plain decoding, the acceptance length with drafts).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class Measurement:
    decode_tokens: int
    decode_s: float
    prefill_s: float
    token_latency_s: list[float] = field(default_factory=list)   # one per step (weights: rows)
    mean_acceptance_length: float | None = None
    roofline_s: float | None = None        # ideal decode time at the machine's ceilings
    draft_s: float = 0.0                   # drafting (heads, n-gram lookup and per-row choice)
    drafted_by_source: dict = field(default_factory=dict)
    accepted_by_source: dict = field(default_factory=dict)
    token_ids: list = field(default_factory=list)        # each row's generated ids (engine systems)

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_engine(engine, prompts, params, gamma, roofline=None, draft: str = "auto", task=None) -> Measurement:
    _sync(engine.device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, gamma=gamma, draft=draft, task=task)
    wall = time.perf_counter() - t0
    stats = engine.last_stats
    # the target's prefill is left out; the heads' fills of prompts (records of no rows, run at a
    # row's first draft) are drafting, which plain decoding never pays, so they stay in decode:
    # left out, summarize's gamma 2 read 1.12x gamma 0 where it took longer end to end
    # (docs/decisions.md, stop 55)
    prefill = sum(p.seconds for p in stats.prefills if p.rows)
    fills = sum(p.seconds for p in stats.prefills if not p.rows)
    latencies = [(s.verify_s + s.draft_s) / (s.emitted / s.rows) for s in stats.steps if s.emitted]
    ideal = sum(roofline.step_s(s.rows * s.query_len) for s in stats.steps) if roofline else None
    return Measurement(sum(len(o.token_ids) - 1 for o in outs if o.token_ids), wall - prefill, prefill,
                       latencies, stats.mean_acceptance_length(), ideal, stats.draft_time_s + fills,
                       dict(stats.drafted_by_source), dict(stats.accepted_by_source), [o.token_ids for o in outs])


class _StepClock:
    """A stopping criterion that never stops and timestamps every decode step, with the
    sequence length it has reached (a prompt-lookup step can add several tokens)."""

    def __init__(self):
        self.times: list[float] = []
        self.lengths: list[int] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        self.lengths.append(input_ids.shape[1])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _left_pad(prompts: list[list[int]], pad_id: int, device):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def run_transformers(model, prompts: list[list[int]], params, pad_id: int, eos_ids, lookup: int = 0) -> Measurement:
    """transformers generate(), batched with left padding; `lookup` > 0: prompt-lookup decoding
    (transformers' draft-free speculation, batch 1 only). With `params.ignore_eos`, pass no
    `eos_ids`: tokens are then counted up to max_new_tokens."""
    from transformers import StoppingCriteriaList

    device = next(model.parameters()).device
    ids, mask = _left_pad(prompts, pad_id, device)
    kwargs = dict(attention_mask=mask, pad_token_id=pad_id, eos_token_id=list(eos_ids) or None)
    if params.temperature > 0:
        kwargs.update(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    else:
        kwargs.update(do_sample=False)
    if lookup:
        kwargs["prompt_lookup_num_tokens"] = lookup
    if params.ignore_eos:           # every row generates max_new_tokens, as the engine's do
        kwargs["min_new_tokens"] = params.max_new_tokens
    clock = _StepClock()
    torch.manual_seed(params.seed)
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=params.max_new_tokens, stopping_criteria=StoppingCriteriaList([clock]), **kwargs)
    _sync(device)
    wall = time.perf_counter() - t0
    new = out[:, ids.shape[1]:]
    finished = torch.zeros(new.shape[0], dtype=torch.bool, device=new.device)
    generated = 0
    for j in range(new.shape[1]):                     # count up to and including EOS, not padding
        generated += int((~finished).sum())
        if eos_ids:
            finished |= torch.isin(new[:, j], torch.tensor(list(eos_ids), device=new.device))
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    first = clock.lengths[0] - ids.shape[1] if clock.lengths else 1     # tokens a row got from the first step
    if lookup and steps:       # a lookup step can emit several tokens: spread the time over them
        per_step = (new.shape[1] - first) / max(len(steps), 1)
        steps = [s / per_step for s in steps]
    prefill = clock.times[0] - t0 if clock.times else wall
    decode = clock.times[-1] - clock.times[0] if clock.times else 0.0
    return Measurement(max(generated - first * len(prompts), 0), max(decode, 1e-9), prefill, steps)


def merged(parts: list[Measurement]) -> Measurement:
    """Calls run one after another (a cell's prompts in batches of its size) as one measurement."""
    return Measurement(sum(m.decode_tokens for m in parts), sum(m.decode_s for m in parts),
                       sum(m.prefill_s for m in parts), [x for m in parts for x in m.token_latency_s])


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]
