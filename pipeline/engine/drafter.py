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

A gamma-0 step skips the heads. What it leaves unfilled waits until the row next drafts: a
prompt's fill (`PendingPrompts`), and the tokens of its gamma-0 steps with their target hidden
states (`Backlog`, up to BACKLOG_TOKENS a row; older ones become a masked gap). Heads that miss
part of a row draft worse for the rest of it: json at gamma 3 drafted 2.33 tokens per step
against 3.16 where the prompt was dropped after three gamma-0 steps (docs/decisions.md,
2026-12-02); complete 2.87 against 3.15 after 48 skipped tokens (2026-12-03). These fills are
prefill work wherever they run: `propose` times them apart (`take_prompt_fill`), so no step's
drafting is priced with them.
"""
from __future__ import annotations

import array
import time
from dataclasses import dataclass, replace

import torch

from pipeline.model import native
from pipeline.model.cache import Batch, KVCache
from pipeline.model.draft_vocab import full_vocab_logits, to_full_vocab
from pipeline.model.layers import native_tokens
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
    prompt: bool = False      # a prompt's fill (its rows' first), from position 0 or from a window's start
    slots: list[int] | None = None    # `rows` on the host, where the caller has them (no device read) ...
    counts: list[int] | None = None   # ... and `count`

    @property
    def of_prompt(self) -> bool:
        """A prompt's fill: its rows' heads carry nothing over a gap before it (`Drafter.gap`)."""
        return self.from_zero or self.prompt

    def select(self, keep: torch.Tensor) -> "PendingFill":
        return PendingFill(self.rows[keep], self.start[keep], self.hidden[keep], self.next_ids[keep],
                           self.count[keep], self.from_zero, self.prompt)

    def without(self, slots: set[int]) -> "PendingFill":
        """The fill less the rows in `slots` (host mirrors kept where it has them)."""
        if self.slots is None or self.counts is None:
            return self.select(~torch.isin(self.rows, torch.tensor(sorted(slots), device=self.rows.device)))
        keep = [i for i, s in enumerate(self.slots) if s not in slots]
        out = self.select(torch.tensor(keep, dtype=torch.long, device=self.rows.device))
        out.slots, out.counts = [self.slots[i] for i in keep], [self.counts[i] for i in keep]
        return out

    def move(self, src: int, dst: int) -> None:
        self.rows[self.rows == src] = dst
        if self.slots is not None:
            self.slots = [dst if s == src else s for s in self.slots]


class PendingPrompts:
    """Prompt fills waiting for their rows' first drafted step. Rows are followed on the host, so
    a row that moves or finishes meanwhile touches no tensor (a large batch at gamma 0 holds one
    per admission); a fill is cut to its remaining rows once, when it runs.
    Example: rows admitted into slots [3, 5]; slot 5 finishes, 3 moves to 1: `take` runs the
    fill's first row only, as slot 1."""

    def __init__(self):
        self.fills: list[tuple[PendingFill, list[int | None], list[int]]] = []   # a fill, its rows' slots
                                                                       # (None: gone), their lengths
        self.slot_of: dict[int, tuple[list, int]] = {}                 # slot -> (its fill's slot list, index)
        self.tokens: dict[int, int] = {}                               # slot -> its prompt's length

    def __bool__(self) -> bool:
        return bool(self.slot_of)

    def add(self, fill: PendingFill, slots: list[int], lengths: list[int]) -> None:
        where = list(slots)
        self.fills.append((fill, where, list(lengths)))
        for i, (s, n) in enumerate(zip(where, lengths)):
            self.slot_of[s] = (where, i)
            self.tokens[s] = n

    def drop(self, slots) -> None:
        for s in slots:
            hit = self.slot_of.pop(s, None)
            if hit is not None:
                hit[0][hit[1]] = None
                self.tokens.pop(s, None)

    def move(self, src: int, dst: int) -> None:
        hit = self.slot_of.pop(src, None)
        if hit is not None:
            hit[0][hit[1]] = dst
            self.slot_of[dst] = hit
            self.tokens[dst] = self.tokens.pop(src)

    def take(self, device) -> list[PendingFill]:
        """The waiting fills, each cut to its remaining rows at their current slots (with their
        slots and lengths on the host: a fill of rows 0..r-1 runs in C, Drafter._fill); none after."""
        out = []
        for fill, where, lengths in self.fills:
            keep = [i for i, s in enumerate(where) if s is not None]
            if not keep:
                continue
            if len(keep) < len(where):
                fill = fill.select(torch.tensor(keep, device=device))
            slots = [where[i] for i in keep]
            out.append(replace(fill, rows=torch.tensor(slots, device=device), slots=slots,
                               counts=[lengths[i] for i in keep]))
        self.fills, self.slot_of, self.tokens = [], {}, {}
        return out


BACKLOG_TOKENS = 16     # a row's gamma-0 tokens kept for its heads' next fill; older ones are a gap
SLICE_ROWS = 4          # a backlog append of at most this many rows copies each row's slice


class Backlog:
    """Per slot, the tokens its heads skipped (gamma-0 steps) with their target hidden states,
    run through the heads before the row's next draft (module docstring). Buffers are made at
    the first skip; counts live on the host (`tokens`: the policy prices the catch-up, and a
    step's fill with host counts is appended without reading the device). A row that would hold
    more than `size` starts over from its newest step: the tokens before are a masked gap (`add`
    returns which rows).
    A step where every row appends one token (each after its own tokens) is held as it is
    (`add_column`: its tensors, and a list of the slot each of its rows sits in now) and written
    into the buffers only when a fill reads them or a step appends several tokens a row
    (`_flush`). A row that ends or moves changes that list, not the tensors; a row that overflows
    drops its held columns unwritten. Most plain steps then copy nothing: at batch 1 keeping the
    backlog cost ~45 us of a 0.8 ms plain step (docs/decisions.md, stop 54); at 32 rows a row
    ending or moving wrote the held columns first (~0.2 ms each), and rows holding different
    counts (every plain step after a drafted one) took the general append, ~130 us a step (stop 60).
    Example: slot 2 skips positions 40, 41, 42: `take` gives one fill of rows [2], start [40],
    count [3]."""

    def __init__(self, batch_size: int, size: int, device):
        self.size, self.batch_size, self.device = size, batch_size, device
        self.hidden: torch.Tensor | None = None        # [B, size, H]
        self.ids: torch.Tensor | None = None           # [B, size] the token after each position
        self.start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.tokens: dict[int, int] = {}               # slot -> tokens held
        self.written: set[int] = set()                 # slots whose buffer rows hold some of them
        self.held: list[tuple] = []      # unwritten: (column, start [r] or None, hidden [r, 1, H], next_ids [r, 1],
                                         # slots: where each of the r rows sits now, None: ended); steps
                                         # of the same rows share one slots list

    def __bool__(self) -> bool:
        return bool(self.tokens)

    def add(self, p: PendingFill) -> list[int]:
        """Append a step's accepted tokens per row; returns the rows (indices into `p`) whose
        older tokens were dropped (their heads' cache has a gap before these)."""
        r, w = p.next_ids.shape
        slots = p.slots if p.slots is not None else p.rows.tolist()
        counts = p.counts if p.counts is not None else p.count.tolist()
        if all(c == 1 for c in counts) and self.add_column(slots, p.start, p.hidden[:, :1],
                                                            p.next_ids[:, :1]) is not None:
            return []
        self._flush()
        self._buffers(p.hidden, p.next_ids)
        over, fresh, skips = [], [], []          # fresh: rows starting a backlog (their start is set)
        moves = []                               # (row in p, slot, from column in p, to column, tokens)
        for i, (slot, c) in enumerate(zip(slots, counts)):
            old = self.tokens.get(slot, 0)
            if old + c > self.size:
                over.append(i)
                old = 0
            skip = max(c - self.size, 0)         # a step longer than the size keeps its newest
            if old == 0:
                fresh.append(i)
                skips.append(skip)
            if c > skip:
                moves.append((i, slot, skip, old, c - skip))
            self.tokens[slot] = old + c - skip
            self.written.add(slot)
        if len(moves) <= SLICE_ROWS:             # a few rows: a copy each (no index tensors to build)
            for i, slot, src, dst, k in moves:
                self.hidden[slot, dst:dst + k] = p.hidden[i, src:src + k]
                self.ids[slot, dst:dst + k] = p.next_ids[i, src:src + k]
        elif moves:                              # one indexed copy, its index built by broadcasting over
            pr, br, pc, bc = _spans(moves, p.rows.device)     # the tokens (not a host list per token)
            self.hidden[br, bc] = p.hidden[pr, pc]
            self.ids[br, bc] = p.next_ids[pr, pc]
        if fresh:
            if len(fresh) == r and not any(skips):
                self.start[p.rows] = p.start
            else:
                f = torch.tensor(fresh, device=p.rows.device)
                self.start[p.rows[f]] = p.start[f] + torch.tensor(skips, device=p.rows.device)
        return over

    def add_column(self, slots: list, start: torch.Tensor, hidden: torch.Tensor, next_ids: torch.Tensor,
                   restart: bool = False) -> list[int] | None:
        """Hold one token for each row of `slots` (host ints, in the order of the rows of `hidden`
        [r, 1, H], `next_ids` [r, 1] and their positions `start` [r]; None: a row that ended,
        skipped), each at the column after its own tokens: no copy (class docstring). A row that
        holds the size already: with `restart` it drops its tokens and starts over from this one,
        as `add` would; without, nothing is done and None returned (the caller takes `add`'s
        general path). Else the slots whose older tokens were dropped.
        Example: slots [4, None, 2] holding 3 and 0 tokens: 4's token goes to column 3, 2's to 0."""
        tokens, size = self.tokens, self.size
        cols = [-1 if s is None else tokens.get(s, 0) for s in slots]     # -1: an ended row
        over = [s for s, c in zip(slots, cols) if c >= size]
        if over:
            if not restart:
                return None
            self._rename(dict.fromkeys(over))          # older tokens dropped, held ones unwritten
            self.written.difference_update(over)
            live_lists = {id(h[4]) for h in self.held if any(x is not None for x in h[4])}
            self.held = [h for h in self.held if id(h[4]) in live_lists]     # (bounded over a long plain run)
            cols = [0 if c >= size else c for c in cols]
        live = [c for c in cols if c >= 0]
        if not live:
            return over
        col = live[0]
        at = col if all(c == col for c in live) else tuple(cols)       # one column for all, or each row's
        last = self.held[-1][4] if self.held else None
        if last is None or last != slots:              # rows that moved or ended since: a list of their own
            last = list(slots)
        self.held.append((at, start if 0 in live else None, hidden, next_ids, last))
        for s, c in zip(slots, cols):
            if c >= 0:
                tokens[s] = c + 1
        return over

    def _buffers(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> None:
        if self.hidden is None:
            self.hidden = hidden.new_zeros(self.batch_size, self.size, hidden.shape[-1])     # from [r, w, H]
            self.ids = next_ids.new_zeros(self.batch_size, self.size)

    def _flush(self) -> None:
        """Write the held columns into the buffers: one copy per run of consecutive columns over
        the same rows (hidden states, ids, and the start of rows a run begins a backlog for)."""
        held, self.held = self.held, []
        i = 0
        while i < len(held):
            at, start, _, _, slots = held[i]
            keep = [k for k, s in enumerate(slots) if s is not None]
            base = _columns(at, keep)                                         # each kept row's first column
            j = i + 1
            while j < len(held) and held[j][4] is slots and _columns(held[j][0], keep) == [c + j - i for c in base]:
                j += 1
            if keep:
                self._buffers(held[i][2], held[i][3])
                hidden = torch.cat([h[2] for h in held[i:j]], dim=1)            # [r, k, H]
                ids = torch.cat([h[3] for h in held[i:j]], dim=1)
                dst = [slots[k] for k in keep]
                in_order = dst == list(range(len(slots)))
                src = slice(None) if in_order else torch.tensor(keep, device=self.device)
                if isinstance(at, int):                                        # one column for all rows
                    cols = slice(at, at + j - i)
                    rows = slice(0, len(slots)) if in_order else torch.tensor(dst, device=self.device)
                else:                                                          # each row from its own column
                    cols = torch.tensor(base, device=self.device)[:, None] + torch.arange(j - i, device=self.device)
                    rows = torch.tensor(dst, device=self.device)[:, None]
                self.hidden[rows, cols] = hidden[src]
                self.ids[rows, cols] = ids[src]
                fresh = [n for n, c in enumerate(base) if c == 0]             # rows starting a backlog here
                if start is not None and fresh:
                    to = torch.tensor([dst[n] for n in fresh], device=self.device)
                    self.start[to] = start[torch.tensor([keep[n] for n in fresh], device=self.device)]
                self.written.update(dst)
            i = j

    def _rename(self, renamed: dict) -> None:
        """Each held slots list: a slot in `renamed` is what it maps to now (None: ended)."""
        seen = None
        for h in self.held:
            if h[4] is not seen:                     # columns of the same rows share their list
                seen = h[4]
                _rename_slots(seen, renamed)

    def drop(self, slots: list[int]) -> None:
        holding = [s for s in slots if self.tokens.pop(s, None) is not None]
        if holding:
            self._rename(dict.fromkeys(holding))
        self.written.difference_update(slots)

    def move(self, src: int, dst: int) -> None:
        n = self.tokens.pop(src, None)
        if n is None:
            return
        self._rename({src: dst})
        if src in self.written:                  # what was written already moves with it
            self.hidden[dst], self.ids[dst] = self.hidden[src], self.ids[src]
            self.start[dst] = self.start[src]
            self.written.discard(src)
            self.written.add(dst)
        self.tokens[dst] = n

    def take(self) -> PendingFill | None:
        """Every held row's tokens as one fill (padded to the longest); none held after."""
        if not self.tokens:
            return None
        self._flush()
        slots = sorted(self.tokens)
        counts = [self.tokens[s] for s in slots]
        rows = torch.tensor(slots, device=self.device)
        width = max(counts)
        fill = PendingFill(rows, self.start[rows], self.hidden[rows, :width], self.ids[rows, :width],
                           torch.tensor(counts, device=self.device), slots=slots, counts=counts)
        self.tokens, self.written = {}, set()
        return fill


def _rename_slots(slots: list, renamed: dict) -> None:
    """In place: each entry of `slots` found in `renamed` becomes what it maps to (None: ended)."""
    for k, s in enumerate(slots):
        if s in renamed:
            slots[k] = renamed[s]


def _columns(at, keep: list[int]) -> list[int]:
    """A held column's backlog column of each of the rows `keep` (one int for all, or per row)."""
    return [at] * len(keep) if isinstance(at, int) else [at[k] for k in keep]


def _coupled_native(pick) -> tuple[float, int, torch.Tensor] | None:
    """(temperature, seed, keys) where `pick` is a coupled draft pick (engine.coupled.CoupledDraftPick)
    that the heads' C drafting may make itself: it draws C noise (the engine's noise on CPU:
    native.exponential_noise) and native.C_DRAFT_PICKS is on. Else None: `pick` picks."""
    keys = getattr(pick, "keys", None)
    if keys is None or keys.device.type != "cpu" or not (native.C_NOISE and native.C_DRAFT_PICKS):
        return None
    return pick.temperature, pick.seed, keys


def _spans(moves: list[tuple[int, int, int, int, int]], device):
    """Index tensors (p rows, backlog rows, p columns, backlog columns) of every token in `moves`
    (row in p, slot, first column in p, first column in the backlog, tokens). A gamma-0 step
    moves one token a row: its index is the moves' own columns. Example: [(0, 5, 1, 3, 2)] ->
    [0, 0], [5, 5], [1, 2], [3, 4]."""
    flat = array.array("q", [x for m in moves for x in m])    # torch.tensor of nested lists: ~70 us at 48 rows
    i, slot, src, dst, k = torch.frombuffer(flat, dtype=torch.long).view(-1, 5).to(device).unbind(1)
    width = max(m[4] for m in moves)
    if width == 1:
        return i, slot, src, dst
    j = torch.arange(width, device=device)
    keep = j < k[:, None]                                                 # [moves, width]
    return (i[:, None].expand(-1, width)[keep], slot[:, None].expand(-1, width)[keep],
            (src[:, None] + j)[keep], (dst[:, None] + j)[keep])


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
        self.pending: list[PendingFill] = []     # the last verify step's accepted tokens (or a probe's)
        self.column: tuple | None = None         # ... or, where rows 0..n-1 kept one each, (start, hidden,
                                                 # next_ids, slots: where each row sits now, None: ended)
        self.prompts = PendingPrompts()            # prompts not yet run through the heads
        self.backlog = Backlog(batch_size, BACKLOG_TOKENS, device)   # gamma-0 steps' tokens, likewise
        self.held: set[int] = set()                # slots whose heads' cache may hold entries (host side)
        self.gap = torch.zeros(batch_size, dtype=torch.bool, device=device)   # [B] tokens lost after its prompt
        self.full_vocab_picks = False  # coupled sampling: a head's draft vocabulary is picked over as -inf columns
        self.native_fill = True        # one head's step fills as one C call where it can (`_fill_native`)
        self.prompt_fill_s = 0.0       # seconds of prompt and backlog fills run by `propose` since the last take ...
        self.prompt_fill_tokens = 0    # ... and the tokens they filled
        self.step_fill_tokens = 0      # tokens the last `propose` ran over the previous step's verify (drafting)

    # ---- slot management -------------------------------------------------------------------
    def reset_rows(self, rows: torch.Tensor) -> None:
        self.valid[:, rows] = False
        self.carry_ok[rows] = False
        self.gap[rows] = False
        self.drop_rows(rows)

    def move_row(self, src: int, dst: int) -> None:
        """A row moves into a hole: its heads' cache only where it holds anything (a batch at
        gamma 0 throughout has nothing there to copy), its masks and waiting fills always."""
        if src in self.held:
            self.cache.move_row(src, dst)
            self.held.discard(src)
            self.held.add(dst)
        self.valid[:, dst] = self.valid[:, src]
        self.carry[:, dst] = self.carry[:, src]
        self.carry_ok[dst] = self.carry_ok[src]
        self.gap[dst] = self.gap[src]
        if self.column is not None:
            _rename_slots(self.column[3], {src: dst})
        for p in self.pending:
            p.move(src, dst)
        self.prompts.move(src, dst)
        self.backlog.move(src, dst)

    def drop_rows(self, rows: torch.Tensor) -> None:
        slots = rows.tolist()                      # rows finish once each: a device read is fine here
        gone = set(slots)
        if self.column is not None:
            _rename_slots(self.column[3], dict.fromkeys(gone))
        if self.pending:
            self.pending = [p.without(gone) for p in self.pending]
        if self.prompts or self.backlog:
            self.prompts.drop(slots)
            self.backlog.drop(slots)

    def add_pending(self, fill: PendingFill) -> None:
        self._column_to_pending()
        self.pending.append(fill)

    def add_column(self, n: int, start: torch.Tensor, hidden: torch.Tensor, next_ids: torch.Tensor) -> None:
        """A verify step where rows 0..n-1 kept one token each (every plain step): `start` [n]
        their positions, `hidden` [n, 1, H], `next_ids` [n, 1]. Held as it is, rows that move or end
        meanwhile followed in a host list: a plain step that follows holds it in the backlog
        as it is too (`discard_pending`), without the PendingFill that a draft makes of it
        (`_column_to_pending`). That fill and its append were ~80 us of host time a plain step
        at 32 rows (docs/decisions.md, stop 53)."""
        self._column_to_pending()
        self.column = (start, hidden, next_ids, list(range(n)))

    def _column_to_pending(self) -> None:
        if self.column is None:
            return
        start, hidden, next_ids, slots = self.column
        self.column = None
        keep = [k for k, s in enumerate(slots) if s is not None]
        if not keep:
            return
        live = [slots[k] for k in keep]
        dev = start.device
        if len(keep) < len(slots):
            idx = torch.tensor(keep, device=dev)
            start, hidden, next_ids = start[idx], hidden[idx], next_ids[idx]
        in_order = live == list(range(len(live)))          # rows 0..r-1: the fill reads views
        rows = torch.arange(len(live), device=dev) if in_order else torch.tensor(live, device=dev)
        self.pending.append(PendingFill(rows, start, hidden, next_ids, torch.ones_like(start),
                                        slots=live, counts=[1] * len(live)))

    def add_prompt(self, fill: PendingFill, slots: list[int], lengths: list[int]) -> None:
        """A prompt's fill (from_zero), run at its rows' first drafted step (module docstring)."""
        self.prompts.add(fill, slots, lengths)

    def discard_pending(self) -> None:
        """A gamma-0 step skips the heads: the last step's accepted tokens join their rows'
        backlog, filled at the next draft (module docstring). Where a backlog overflows, its
        older tokens are a masked gap: no carry crosses it, nor one from a waiting prompt (`gap`)."""
        if self.column is not None and not self.pending:
            start, hidden, next_ids, slots = self.column
            over = self.backlog.add_column(slots, start, hidden, next_ids, restart=True)
            self.column = None
            if over:
                lost = torch.tensor(over, device=start.device)
                self.carry_ok[lost] = False
                self.gap[lost] = True
            return
        self._column_to_pending()
        for p in self.pending:
            if p.rows.numel():
                over = self.backlog.add(p)
                if over:
                    lost = p.rows[torch.tensor(over, device=p.rows.device)]
                    self.carry_ok[lost] = False
                    self.gap[lost] = True
        self.pending = []

    # ---- drafting ----------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, n: int, lengths: torch.Tensor, gamma: int, pick):
        """Drafts for active rows 0..n-1. `lengths` [n]: target cache lengths.
        `pick(logits [n, V], depth) -> (tokens [n], probs [n, V] or None)` samples a draft (over the
        heads' draft vocabulary, [n, Vd], where they have one; mapped back to V here).
        Returns (drafts [n, gamma], draft_probs [n, gamma, V] or None)."""
        self._column_to_pending()
        first_out = torch.empty(n, self.carry.shape[-1], dtype=self.carry.dtype, device=self.carry.device)
        if self.prompts or self.backlog:   # in position order: prompts, skipped steps, the last step
            t0 = self._clock()
            self.prompt_fill_tokens += sum(self.prompts.tokens.values()) + sum(self.backlog.tokens.values())
            for p in self.prompts.take(self.carry.device):
                first_out[p.rows] = self._fill(p)
            if (b := self.backlog.take()) is not None:
                first_out[b.rows] = self._fill(b)
            self.prompt_fill_s += self._clock() - t0
        self.step_fill_tokens = 0
        for p in self.pending:
            if p.rows.numel():
                got = self._fill(p)
                if p.slots is not None and len(p.slots) == n and p.slots == list(range(n)):
                    first_out = got              # every row, in order (it supersedes earlier fills)
                else:
                    first_out[p.rows] = got
                self.step_fill_tokens += p.next_ids.numel()
        self.pending = []
        self.held.update(range(n))                 # every drafting row's entries are filled now
        coupled = _coupled_native(pick)
        if (getattr(pick, "greedy", False) and not self.full_vocab_picks) or coupled is not None:
            drafts = self._greedy_native(n, lengths, gamma, first_out, coupled)
            if drafts is not None:
                return drafts, None
        k = len(self.heads)
        out, drafts, probs = first_out, [], []
        deepest = int(lengths.max()) + gamma - 1 if gamma > 1 else 0   # keys the last depth reads
        visible = {}                # head -> [n, deepest] keys it may attend, up to its last depth
        for depth in range(1, gamma + 1):
            c = head_for_depth(k, depth)
            head = self.heads[c]
            if depth > 1:
                pos = lengths + depth - 2                                        # [n]
                if c not in visible:
                    visible[c] = self._visible(c, n, lengths, gamma, deepest)
                kv_len = deepest - (gamma - depth)
                batch = Batch.make(pos[:, None], kv_len=kv_len, key_valid=visible[c][:, :kv_len])
                out = head(out[:, None], drafts[-1][:, None], batch, self.cache, c)[:, 0]
            logits, ids = head.draft_logits(out)                     # ids: the draft vocabulary or None
            if ids is not None and self.full_vocab_picks:            # noise keyed by token id: all V columns
                logits, ids = full_vocab_logits(logits, ids, head.vocab_size), None
            tok, prob = to_full_vocab(*pick(logits, depth), ids, head.vocab_size)
            drafts.append(tok)
            probs.append(prob)
        draft_probs = torch.stack(probs, dim=1) if probs and probs[0] is not None else None
        return torch.stack(drafts, dim=1), draft_probs

    def _greedy_native(self, n: int, lengths: torch.Tensor, gamma: int, out: torch.Tensor,
                       coupled: tuple | None = None) -> torch.Tensor | None:
        """Greedy drafts [n, gamma] as `propose`'s loop makes them, by one C call per head
        (native.mtp_greedy: its forward, output and argmax at each of its depths), from `out`
        [n, hidden], depth 1's hidden state (overwritten); None where a head has no C path for
        n rows (not CPU float32, a linear off the native GEMM) or RoPE has no tables.
        coupled (temperature, seed, keys): coupled sampling's picks instead (`_coupled_native`)."""
        heads, k = self.heads, len(self.heads)
        nds = [heads[c].greedy_native() for c in range(min(k, gamma))]   # (slicing a ModuleList builds one)
        if out.dtype != torch.float32 or any(nd is None or (nd.max_tokens is not None and n > nd.max_tokens)
                                             for nd in nds):
            return None
        deepest = int(lengths.max()) + gamma - 1 if gamma > 1 else 0
        tables = heads[0]._target.rope_tables(deepest + 1)
        if tables is None:
            return None
        tokens = torch.empty(n, gamma, dtype=torch.long, device=out.device)
        h, depth = out.contiguous(), 1
        while depth <= gamma:                    # a run of depths drafted by one head
            c = head_for_depth(k, depth)
            last = depth if c < k - 1 else gamma
            native.mtp_greedy(nds[c], n, depth, last, h, lengths, *tables, self.cache.k[c], self.cache.v[c],
                              self.valid[c, :n], tokens, max(c - 1, 0), gamma - 2, coupled)   # `_visible`'s mask
            depth = last + 1
        return tokens

    def _visible(self, c: int, n: int, lengths: torch.Tensor, gamma: int, deepest: int) -> torch.Tensor:
        """[n, deepest] keys head c may attend while drafting: its filled entries, and the drafts
        of this step from its first draft position (lengths + c - 1) to the last depth's. Built
        once for all the head's depths: a query at an earlier depth sees none of the later
        drafts anyway (the mask is causal), so each depth reads a prefix view of it."""
        keys = torch.arange(deepest, device=lengths.device)
        lo, hi = lengths + max(c - 1, 0), lengths + gamma - 2
        return self.valid[c, :n, :deepest] | ((keys >= lo[:, None]) & (keys <= hi[:, None]))

    def take_prompt_fill(self) -> tuple[float, int]:
        """(seconds, tokens) of the prompt and backlog fills `propose` ran since the last take
        (prefill work, not drafting)."""
        out = self.prompt_fill_s, self.prompt_fill_tokens
        self.prompt_fill_s, self.prompt_fill_tokens = 0.0, 0
        return out

    def _clock(self) -> float:
        if self.carry.device.type == "cuda":
            torch.cuda.synchronize(self.carry.device)
        return time.perf_counter()

    def _fill_native(self, p: PendingFill, r: int, w: int) -> torch.Tensor | None:
        """`_fill` for one head over rows 0..r-1 as one C call (native.mtp_fill), or None where
        the head's forward has no C path for r x w tokens. Its rotary tables cover the cache's
        capacity (no read of the positions' maximum)."""
        head = self.heads[0]
        nh = head.native_head
        if nh is None or not native_tokens(p.hidden, self.cache, nh.max_tokens):
            return None
        tables = head._target.rope_tables(self.cache.capacity)
        if tables is None:
            return None
        carry = self.carry[0, :r]
        native.mtp_fill(nh, p.start, p.count, p.next_ids, p.hidden, *tables, self.cache.k[0], self.cache.v[0],
                        self.valid[0, :r], carry)
        self.carry_ok[:r] = ~self.gap[:r] if p.of_prompt else True      # as `_fill` sets it
        return carry.clone()                 # the caller's depth-1 state, overwritten by drafting

    def _fill(self, p: PendingFill) -> torch.Tensor:
        """Run every head over a pending range (cascade); returns head 1's output at the last
        valid position of each row, from which depth 1 is drafted. A step's fill of rows
        0..r-1 (`prefix`) reads and writes the heads' masks through views, not gathers."""
        r, w = p.next_ids.shape
        dev = p.rows.device
        prefix = p.slots is not None and p.slots == list(range(r))
        if prefix and len(self.heads) == 1 and self.native_fill:
            got = self._fill_native(p, r, w)
            if got is not None:
                return got
        rows = slice(0, r) if prefix else p.rows
        steps = torch.arange(w, device=dev)
        positions = p.start[:, None] + steps                                   # [r, w]
        in_range = steps < p.count[:, None]                                    # [r, w]
        last = p.count - 1
        idx = torch.arange(r, device=dev)
        kv_len = int(positions.max()) + 1
        prev, first = p.hidden, None
        for c, head in enumerate(self.heads):
            ok = in_range if c == 0 else in_range & ((steps >= c) | self.carry_ok[rows, None])
            if prefix:
                self.valid[c, :r].scatter_(1, positions, ok)
            else:
                self.valid[c, p.rows[:, None], positions] = ok
            if p.from_zero and c == 0:        # head 1 over a prompt: plain causal, no mask tensor
                batch = Batch.from_start(r, w, dev, rows=p.rows)
            else:
                batch = Batch.make(positions, rows=None if prefix else p.rows, kv_len=kv_len,
                                   key_valid=self.valid[c, rows, :kv_len])
            out = head(prev, p.next_ids, batch, self.cache, c)                 # [r, w, hidden]
            if c + 1 < len(self.heads):
                prev = torch.cat([self.carry[c, rows][:, None], out[:, :-1]], dim=1)
            at_last = out[idx, last]
            self.carry[c, rows] = at_last
            if first is None:
                first = at_last
        self.carry_ok[rows] = ~self.gap[rows] if p.of_prompt else True
        return first
