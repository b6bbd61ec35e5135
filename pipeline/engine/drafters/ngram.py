"""N-gram (suffix) drafting: the tokens that followed the row's newest n-gram the last time it
occurred, in the row's own prompt and output, else in the task's recent outputs (TaskIndex).
Free of model cost; each proposal is deterministic (q one-hot), and its length comes from the
match (what followed it, up to max_len, and short of the row's token budget: a row with r
tokens left emits at most r, so drafts past r - 1 are verify work for nothing). Host cost is a
few dict operations per row per step (each row's index grows only by the tokens it emitted since
it last drafted); the source times it (Proposal.seconds), which the cost model prices per row.
"""
from __future__ import annotations

import random
import time

import torch

from pipeline.engine.drafters.base import DraftRequest, Proposal
from pipeline.engine.drafters.task_index import TaskIndex
from pipeline.engine.rows import Row
from pipeline.spec_decode.acceptance import PAD

MAX_ORDER = 3            # longest suffix matched in a row's own tokens
PROBE_VOCAB = 64         # a probe's made-up tokens: few enough that short n-grams recur, as in text
PROBE_TOKENS = 64        # ... and at most this many per row (a lookup's cost does not grow with the context)


class RowIndex:
    """n-gram -> newest end position in one row's prompt + output (ends before the last token)."""
    __slots__ = ("seq", "ends", "done")

    def __init__(self, prompt: list[int]):
        self.seq = list(prompt)
        self.ends: dict[tuple, int] = {}
        self.done = 0              # ends 1..done are indexed

    def extend(self, tokens: list[int], prompt_len: int) -> None:
        """Index the n-grams (orders 1..MAX_ORDER) ending at the new positions, newest end winning.
        One `dict.update` over zipped shifted slices per order: a 114-token prompt's first
        indexing was the largest host cost of a batch-48 step's lookup as a loop of tuple slices."""
        seq = self.seq
        if len(seq) < prompt_len + len(tokens):
            seq.extend(tokens[len(seq) - prompt_len:])
        ends, lo, hi = self.ends, self.done + 1, len(seq) - 1    # new ends: a key's continuation seq[e] exists
        if hi - lo < 8:                                # a step's few tokens: the plain loop is cheaper
            for e in range(lo, hi + 1):
                for m in range(1, min(MAX_ORDER, e) + 1):
                    ends[tuple(seq[e - m:e])] = e
        else:
            for m in range(1, MAX_ORDER + 1):
                start = max(lo, m)                     # keys seq[e - m:e] for e in start..hi, in order
                ends.update(zip(zip(*[seq[start - m + j:hi - m + j + 1] for j in range(m)]), range(start, hi + 1)))
        self.done = max(self.done, hi)

    def match(self, task: TaskIndex | None, k: int, after: list[int] = ()) -> tuple[list[int], int]:
        """(draft tokens, match length): own 3-gram, task 3-gram, own 2-gram, task 2-gram, own 1-gram.
        `after`: tokens taken as following the row's (the heads' drafts, for a tail), matched on
        but not indexed; a match that ends near the row's end continues into them.
        Example: row [5, 6, 7, 8, 9], after [5, 6]: the 2-gram (5, 6) ends at 2: [7, 8, 9, 5, 6][:k]."""
        seq = self.seq
        if after:
            seq = seq[-MAX_ORDER:] + list(after)         # the key's tokens; continuations read both
        n = len(self.seq) + len(after)
        for m in range(min(MAX_ORDER, n), 0, -1):
            key = tuple(seq[len(seq) - m:])
            e = self.ends.get(key)
            if e is not None:
                got = self.seq[e:e + k]
                return got + list(after[:k - len(got)]) if after else got, m
            if task is not None and m in task.orders:
                got = task.lookup(key, k)
                if got:
                    return got, m
        return [], 0


class NgramSource:
    name = "ngram"
    deterministic = True
    needs_hidden = False
    cost_per = "row"

    def __init__(self, task_index: TaskIndex | None, device):
        self.task, self.device = task_index, device
        self.rows: dict[int, RowIndex] = {}          # Row.index -> its index

    def propose(self, req: DraftRequest) -> Proposal:
        """Every row's match, timed (host work only: Proposal.seconds, the cost model's lookup)."""
        t0 = time.perf_counter()
        k = req.max_len
        drafts = [[PAD] * k for _ in range(req.n)]
        lens, match = [0] * req.n, [0] * req.n
        for i, row in enumerate(req.rows):
            if row is None:
                continue
            idx = self._index(row)
            left = row.max_new - len(row.tokens) - 1     # drafts past its budget would never be emitted
            if left <= 0:
                continue
            got, m = idx.match(self.task, min(k, left))
            if got:
                drafts[i][:len(got)] = got
                lens[i], match[i] = len(got), m
        return Proposal(torch.tensor(drafts, dtype=torch.long, device=self.device).view(req.n, k),
                        torch.tensor(lens, dtype=torch.long, device=self.device), None, match,
                        time.perf_counter() - t0, lens)

    def probe(self, rows: int, depth: int, ctx: int):
        """A lookup for `rows` made-up rows (indexed before the first call), each one token longer
        per call: a step's work, the new token indexed and then the match."""
        rng = random.Random(0)
        width = max(1, min(ctx, PROBE_TOKENS))
        fake = [Row(-1 - i, [rng.randrange(PROBE_VOCAB) for _ in range(width)], 1 << 30, None) for i in range(rows)]
        req = DraftRequest(rows, torch.full((rows,), ctx, device=self.device), depth, None, fake)
        self.propose(req)

        def run():
            for row in fake:
                row.tokens.append(rng.randrange(PROBE_VOCAB))
            return self.propose(req)
        return run

    def _index(self, row: Row) -> RowIndex:
        """The row's index, brought up to its newest token."""
        idx = self.rows.get(row.index)
        if idx is None:
            idx = self.rows[row.index] = RowIndex(row.prompt_ids)
        idx.extend(row.tokens, len(row.prompt_ids))
        return idx

    def tails(self, rows: list, heads: list[list[int]], k: int) -> tuple[list[list[int]], list[int]]:
        """For rows that drafted `heads` tokens with the MTP heads: the n-gram continuation after
        them (at most k, within the row's budget) and its match length. A row's entry in `rows`
        may be None (no tail). The caller times it with its choice. Example: heads [[7, 8]] on a
        row whose own text holds 7 8 9 10 earlier: tail [9, 10], match 2."""
        out, match = [[] for _ in rows], [0] * len(rows)
        for i, (row, after) in enumerate(zip(rows, heads)):
            if row is None:
                continue
            left = min(k, row.max_new - len(row.tokens) - 1 - len(after))
            if left <= 0:
                continue
            out[i], match[i] = self._index(row).match(self.task, left, after)
            if not out[i]:
                match[i] = 0
        return out, match

    def after_prefill(self, slots, hidden, ids, lens, first) -> None:
        pass

    def after_verify(self, n, lengths, hidden, emitted, num_accepted, accepted) -> None:
        pass

    def skip(self) -> None:
        pass

    def reset_rows(self, rows) -> None:
        pass

    def move_row(self, src: int, dst: int) -> None:
        pass                      # indexed by the row, not the slot

    def drop_rows(self, rows) -> None:
        pass

    def waiting_tokens(self) -> dict[int, int]:
        return {}                 # its rows' indexes catch up inside the lookup, which it times

    def take_prompt_fill(self) -> tuple[float, int]:
        return 0.0, 0

    def last_fill_tokens(self) -> int:
        return -1

    def finish_rows(self, rows) -> None:
        """Finished rows: their outputs join the task's index; their own indexes go."""
        for row in rows:
            self.rows.pop(row.index, None)
            if self.task is not None:
                self.task.add(row.tokens)
