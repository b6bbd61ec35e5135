"""Retries, and narrowing a shard that keeps failing down to the rows that make it fail.

A shard is tried whole up to `shards.max_attempts` times: an actor can die for reasons that
have nothing to do with its rows (a lost node, an OOM kill, a test's `ray.kill`), and then the
next try, on another or a restarted actor, simply redoes the shard. When every whole try has
failed, the shard's rows are probed in halves. A probe generates a slice of the shard and
throws the output away; a probe that fails is split again, down to single rows, and a single
row that fails on its own is a bad row. When no probe is left the shard is tried once more,
whole, with its bad rows written as error rows (never sent to the engine): that try commits
the rest of the shard. If it fails as well, every row of the shard is written with the error.

Worked example, rows 0..5 of which row 4 kills its actor, max_attempts=2: tries 1 and 2 (whole)
fail; probes [0, 3) pass, [3, 6) fails; [3, 4) passes, [4, 6) fails; [4, 5) fails (row 4 is
bad), [5, 6) passes; try 9 runs rows 0..5 with row 4 as an error row and commits. The shard's
`attempt` is 9: every try counts, probes included.

A probe costs a second generation of its rows; that is paid only by shards that failed
`max_attempts` times, and it keeps a crash-inducing row from costing the shard's other rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.data.plan import Shard


@dataclass(frozen=True)
class Try:
    shard: Shard
    attempt: int                                  # tries of this shard so far, this one included
    probe: tuple[int, int] | None = None          # rows [lo, hi) of the shard; output discarded
    bad_rows: tuple[tuple[int, str], ...] = ()    # (row of the shard, error) written as errors
    final: bool = False                           # the try after narrowing: its failure gives up


@dataclass
class _Narrowing:
    open: set[tuple[int, int]] = field(default_factory=set)   # probes not yet answered
    bad: dict[int, str] = field(default_factory=dict)         # row -> why it failed alone


class Retries:
    """Which tries follow a success or a failure, per shard. Pure bookkeeping (no Ray)."""

    def __init__(self, max_attempts: int) -> None:
        self.max_attempts = max_attempts
        self.attempts: dict[int, int] = {}      # shard_id -> tries started
        self.whole: dict[int, int] = {}         # shard_id -> whole tries started
        self.narrowing: dict[int, _Narrowing] = {}

    def first(self, shard: Shard) -> Try:
        return self._next(shard)

    def passed(self, t: Try) -> list[Try]:
        """Tries that follow a successful `t` (a committed shard needs none)."""
        if t.probe is None:
            return []
        state = self.narrowing[t.shard.shard_id]
        state.open.discard(t.probe)
        return self._final_if_done(t.shard)

    def failed(self, t: Try, why: str) -> list[Try] | None:
        """Tries that follow a failed `t`; None: give up (every row of the shard gets `why`)."""
        sid = t.shard.shard_id
        if t.final:
            return None
        if t.probe is None:
            if self.whole[sid] < self.max_attempts:
                return [self._next(t.shard)]
            if t.shard.num_rows < 2:
                return None
            self.narrowing[sid] = _Narrowing()
            return self._split(t.shard, 0, t.shard.num_rows)
        state = self.narrowing[sid]
        state.open.discard(t.probe)
        lo, hi = t.probe
        if hi - lo > 1:
            return self._split(t.shard, lo, hi)
        state.bad[lo] = (f"this row fails on its own ({why}); the shard's other rows were "
                         "committed without it")
        return self._final_if_done(t.shard)

    def _split(self, shard: Shard, lo: int, hi: int) -> list[Try]:
        mid = (lo + hi) // 2
        halves = [(lo, mid), (mid, hi)]
        self.narrowing[shard.shard_id].open.update(halves)
        return [self._next(shard, probe=h) for h in halves]

    def _final_if_done(self, shard: Shard) -> list[Try]:
        state = self.narrowing[shard.shard_id]
        if state.open:
            return []
        del self.narrowing[shard.shard_id]
        return [self._next(shard, bad_rows=tuple(sorted(state.bad.items())), final=True)]

    def _next(self, shard: Shard, **kwargs) -> Try:
        sid = shard.shard_id
        self.attempts[sid] = self.attempts.get(sid, 0) + 1
        if not kwargs:
            self.whole[sid] = self.whole.get(sid, 0) + 1
        return Try(shard, self.attempts[sid], **kwargs)


def failures_tolerated(num_actors: int, max_attempts: int, rows_per_shard: int) -> int:
    """Failed tries in a row (no success between them) after which the pool stops: enough for
    every actor to be narrowing a shard down to one bad row at once (max_attempts whole tries,
    then one failing probe per halving), so only failures that are not about rows stop a run."""
    depth = max(rows_per_shard - 1, 1).bit_length()      # halvings from rows_per_shard to 1 row
    return num_actors * (max_attempts + depth + 2)
