"""Cache rows ("slots") of the running batch. Active rows are kept in slots 0..n-1 so every
forward reads the caches as views; a finished row's slot is refilled from the queue at once,
and when the queue is empty the last active row moves into the hole (one row copied, once)."""
from __future__ import annotations

import torch

from pipeline.engine.rows import Row


class Slots:
    def __init__(self, batch_size: int, device, sources, cache):
        self.rows: list[Row | None] = [None] * batch_size
        self.n = 0                                                                # slots in use: 0..n-1
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)   # [B] cached tokens
        self.last_token = torch.zeros(batch_size, dtype=torch.long, device=device)  # [B] newest, uncached
        self.keys = torch.zeros(batch_size, dtype=torch.long, device=device)      # [B] random-stream key
        self.sources, self.cache = sources, cache      # the draft sources (drafters.Sources) follow the rows

    def free_slots(self) -> list[int]:
        holes = [i for i in range(self.n) if self.rows[i] is None]
        return holes + list(range(self.n, len(self.rows)))

    def place(self, slot_ids: list[int], rows: list[Row], lengths: torch.Tensor, first: torch.Tensor) -> None:
        idx = torch.tensor(slot_ids, device=self.lengths.device)
        for s, r in zip(slot_ids, rows):
            self.rows[s] = r
        self.lengths[idx] = lengths
        self.last_token[idx] = first
        self.keys[idx] = torch.tensor([r.key for r in rows], device=idx.device)
        self.n = max(self.n, max(slot_ids) + 1)
        if self.sources is not None:
            self.sources.reset_rows(idx)

    def advance(self, n: int, num_accepted: torch.Tensor, emitted: torch.Tensor) -> None:
        """Rows 0..n-1 keep their accepted drafts: lengths grow by accepted + 1 (the last input
        token plus the accepted drafts); the recovered or bonus token becomes the newest token."""
        if emitted.shape[1] == 1:                  # a plain step: one token a row (~10 us less host work)
            self.lengths[:n].add_(1)
            self.last_token[:n] = emitted[:, 0]
            return
        self.lengths[:n].add_(num_accepted).add_(1)
        self.last_token[:n] = emitted.gather(1, num_accepted[:, None])[:, 0]

    def release_finished(self) -> None:
        done = [i for i in range(self.n) if self.rows[i] is not None and self.rows[i].finished]
        finished = [self.rows[i] for i in done]
        for i in done:
            self.rows[i] = None
        if done and self.sources is not None:
            self.sources.drop_rows(torch.tensor(done, device=self.lengths.device))
            self.sources.finish_rows(finished)
        self._trim()

    def compact(self) -> None:
        holes = [i for i in range(self.n) if self.rows[i] is None]
        for hole in holes:
            self._trim()
            if hole >= self.n:
                break
            self._move(self.n - 1, hole)
            self._trim()

    def _move(self, src: int, dst: int) -> None:
        self.rows[dst], self.rows[src] = self.rows[src], None
        for t in (self.lengths, self.last_token, self.keys):
            t[dst] = t[src]
        self.cache.move_row(src, dst, int(self.lengths[src]))      # its cached tokens, not the capacity
        if self.sources is not None:
            self.sources.move_row(src, dst)

    def _trim(self) -> None:
        while self.n and self.rows[self.n - 1] is None:
            self.n -= 1
