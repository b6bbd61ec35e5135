"""MTP drafting: keeps each head's KV cache filled for prompt and accepted tokens, and proposes
gamma draft tokens per row.

Position convention (chain form of DeepSeek-V3 MTP). A row whose target cache holds positions
0..L-1 and whose newest token t_L is not yet cached drafts as follows:
- depth 1: head 1 at position L-1 on (h_{L-1}, t_L). This is the last entry of the *fill*, which
  runs head k over the positions the last verify step accepted (or the prompt), so the heads'
  caches hold entries for every accepted token.
- depth j >= 2: head min(j, K) at position L+j-2 on (its previous output, d_{j-1}).
Head k at position i thus takes head k-1's output at i-1: DeepSeek's depth-k input shifted by
k-1 positions, which RoPE's relative form makes the same attention. Entries a head cannot have
(gaps after gamma-0 steps, the first k-1 positions of a prompt) are masked by `valid`.

A gamma-0 step skips the heads, and what it leaves unfilled becomes such a gap, except a
prompt's fill: it stays pending until the row next drafts. Heads that never saw the prompt
draft far worse for the row's whole length (json at gamma 3: 2.33 tokens per step against 3.16
where the first three steps ran gamma 0; docs/decisions.md, 2026-12-02), while a gap of a few
generated tokens costs nothing measurable. A prompt's fill is prefill work wherever it runs:
`propose` times it apart (`take_prompt_fill_s`), so no step's drafting is priced with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import time

import torch

from pipeline.model.cache import Batch, KVCache
from pipeline.model.draft_vocab import full_vocab_logits, to_full_vocab
from pipeline.model.mtp import head_for_depth


@dataclass
class PendingFill:
    """Positions whose target hidden states are known but not yet run through the heads."""
    rows: torch.Tensor        # [r] cache rows
    start: torch.Tensor       # [r] position of the first entry
    hidden: torch.Tensor      # [r, w, hidden] target hidden states at start..start+w-1
    next_ids: torch.Tensor    # [r, w] the token after each position
    count: torch.Tensor       # [r] valid entries (the rest is padding)
    from_zero: bool = False   # a prompt: every row starts at position 0
    gap_after: torch.Tensor | None = None   # [r] bool: the positions after it were skipped (carry invalid)

    def select(self, keep: torch.Tensor) -> "PendingFill":
        gap = None if self.gap_after is None else self.gap_after[keep]
        return PendingFill(self.rows[keep], self.start[keep], self.hidden[keep], self.next_ids[keep],
                           self.count[keep], self.from_zero, gap)


class Drafter:
    def __init__(self, heads, batch_size: int, capacity: int, hidden_size: int, dtype, device,
                 cache: KVCache | None = None):
        """`cache`: the heads' KV cache to use (at least this size), else a new one."""
        self.heads = heads
        k = len(heads)
        attn = heads[0].self_attn
        self.cache = cache or KVCache(k, batch_size, capacity, attn.num_kv_heads, attn.head_dim, dtype, device)
        batch_size, capacity = self.cache.k.shape[1], self.cache.capacity
        self.valid = torch.zeros(k, batch_size, capacity, dtype=torch.bool, device=device)   # [K, B, T]
        self.carry = torch.zeros(k, batch_size, hidden_size, dtype=dtype, device=device)     # [K, B, H]
        self.carry_ok = torch.zeros(batch_size, dtype=torch.bool, device=device)            # [B]
        self._carry_set = False       # False: carry_ok is all False (a run of gamma-0 steps skips resetting it)
        self.pending: list[PendingFill] = []
        self.full_vocab_picks = False  # coupled sampling: a head's draft vocabulary is picked over as -inf columns
        self.prompt_fill_s = 0.0       # seconds of prompt fills run by `propose` since the last take

    # ---- slot management -------------------------------------------------------------------
    def reset_rows(self, rows: torch.Tensor) -> None:
        self.valid[:, rows] = False
        self.carry_ok[rows] = False
        self._drop_pending(rows)

    def move_row(self, src: int, dst: int) -> None:
        self.cache.move_row(src, dst)
        self.valid[:, dst] = self.valid[:, src]
        self.carry[:, dst] = self.carry[:, src]
        self.carry_ok[dst] = self.carry_ok[src]
        for p in self.pending:
            p.rows[p.rows == src] = dst

    def drop_rows(self, rows: torch.Tensor) -> None:
        self._drop_pending(rows)

    def _drop_pending(self, rows: torch.Tensor) -> None:
        kept = (p.select(~torch.isin(p.rows, rows)) for p in self.pending)
        self.pending = [p for p in kept if p.rows.numel()]

    def add_pending(self, fill: PendingFill) -> None:
        self.pending.append(fill)

    def discard_pending(self) -> None:
        """A gamma-0 step skips the heads: the accepted tokens of the last step become a masked
        gap, so no such row's carry is valid after it. Prompt fills stay pending (module
        docstring), marked where a dropped fill follows them.
        Example: a row admitted, then two gamma-0 steps: its prompt fill is kept at the first
        (nothing of it dropped yet), the second drops its first step's fill and marks the gap."""
        if self._carry_set:
            self.carry_ok.zero_()
            self._carry_set = False
        kept = [p for p in self.pending if p.from_zero]
        dropped = [p.rows for p in self.pending if not p.from_zero]
        if kept and dropped:
            gap = torch.cat(dropped)
            for p in kept:
                hit = torch.isin(p.rows, gap)
                p.gap_after = hit if p.gap_after is None else p.gap_after | hit
        self.pending = kept

    # ---- drafting ----------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, n: int, lengths: torch.Tensor, gamma: int, pick):
        """Drafts for active rows 0..n-1. `lengths` [n]: target cache lengths.
        `pick(logits [n, V], depth) -> (tokens [n], probs [n, V] or None)` samples a draft (over the
        heads' draft vocabulary, [n, Vd], where they have one; mapped back to V here).
        Returns (drafts [n, gamma], draft_probs [n, gamma, V] or None)."""
        first_out = torch.empty(n, self.carry.shape[-1], dtype=self.carry.dtype, device=self.carry.device)
        prompts = [p for p in self.pending if p.from_zero]     # each its rows' first fill: run them first
        if prompts:
            t0 = self._clock()
            for p in prompts:
                first_out[p.rows] = self._fill(p)
            self.prompt_fill_s += self._clock() - t0
        for p in self.pending:
            if not p.from_zero and p.rows.numel():
                first_out[p.rows] = self._fill(p)
        self.pending = []
        k = len(self.heads)
        out, drafts, probs = first_out, [], []
        keys = torch.arange(self.cache.capacity, device=lengths.device)
        for depth in range(1, gamma + 1):
            c = head_for_depth(k, depth)
            head = self.heads[c]
            if depth > 1:
                pos = lengths + depth - 2                                        # [n]
                lo = lengths + max(c - 1, 0)
                kv_len = int(pos.max()) + 1
                key_valid = self.valid[c, :n, :kv_len] | ((keys[:kv_len] >= lo[:, None]) & (keys[:kv_len] <= pos[:, None]))
                batch = Batch.make(pos[:, None], kv_len=kv_len, key_valid=key_valid)
                out = head(out[:, None], drafts[-1][:, None], batch, self.cache, c)[:, 0]
            logits, ids = head.draft_logits(out)                     # ids: the draft vocabulary or None
            if ids is not None and self.full_vocab_picks:            # noise keyed by token id: all V columns
                logits, ids = full_vocab_logits(logits, ids, head.vocab_size), None
            tok, prob = to_full_vocab(*pick(logits, depth), ids, head.vocab_size)
            drafts.append(tok)
            probs.append(prob)
        draft_probs = torch.stack(probs, dim=1) if probs and probs[0] is not None else None
        return torch.stack(drafts, dim=1), draft_probs

    def take_prompt_fill_s(self) -> float:
        """Seconds `propose` spent on prompt fills since the last take (prefill work, not drafting)."""
        seconds, self.prompt_fill_s = self.prompt_fill_s, 0.0
        return seconds

    def _clock(self) -> float:
        if self.carry.device.type == "cuda":
            torch.cuda.synchronize(self.carry.device)
        return time.perf_counter()

    def _fill(self, p: PendingFill) -> torch.Tensor:
        """Run every head over a pending range (cascade); returns head 1's output at the last
        valid position of each row, from which depth 1 is drafted."""
        r, w = p.next_ids.shape
        steps = torch.arange(w, device=p.rows.device)
        positions = p.start[:, None] + steps                                   # [r, w]
        in_range = steps < p.count[:, None]                                    # [r, w]
        last = p.count - 1
        idx = torch.arange(r, device=p.rows.device)
        kv_len = int(positions.max()) + 1
        prev, first = p.hidden, None
        for c, head in enumerate(self.heads):
            ok = in_range & ((steps >= c) | self.carry_ok[p.rows, None])
            self.valid[c, p.rows[:, None], positions] = ok
            if p.from_zero and c == 0:        # head 1 over a prompt: plain causal, no mask tensor
                batch = Batch.from_start(r, w, p.rows.device, rows=p.rows)
            else:
                batch = Batch.make(positions, rows=p.rows, kv_len=kv_len, key_valid=self.valid[c, p.rows, :kv_len])
            out = head(prev, p.next_ids, batch, self.cache, c)                 # [r, w, hidden]
            if c + 1 < len(self.heads):
                prev = torch.cat([self.carry[c, p.rows][:, None], out[:, :-1]], dim=1)
            self.carry[c, p.rows] = out[idx, last]
            if first is None:
                first = out[idx, last]
        self.carry_ok[p.rows] = True if p.gap_after is None else ~p.gap_after
        self._carry_set = True
        return first
