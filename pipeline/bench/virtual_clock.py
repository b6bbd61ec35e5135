"""A clock that charges model forwards a fixed, measured price per shape: decisions compared
without the machine's timing noise.

On a shared CPU one 0.1-0.3 s call swings 5-10% between runs, more than the gap between two
gamma policies. Under a `VirtualClock` every forward of the target and of the MTP heads is
charged what the first forwards of its shape bucket measured (the fastest of `reps` reruns:
on a shared machine a rerun is slowed by others' work, never sped up, so the minimum is the
forward's own cost; the median kept contended spells: at batch 1 one table priced 3 tokens 40%
above 4), the same price for every system in the run, while host work (the policy, the n-gram lookup,
acceptance) keeps its real time. `time.perf_counter` is replaced for the clock's lifetime, so
the engine measures, profiles and learns from these prices exactly as it would from real ones,
and a benchmark's timing reads them too. What it answers: which decisions a policy makes and
what they are worth at this machine's prices, not how fast the machine is today.

    clock = VirtualClock()
    with clock.installed():
        engine.generate(prompts, gamma="auto")   # perf_counter deltas: host time + table prices
    clock.save("prices.json")                    # reuse with VirtualClock.load: same prices, next run

A rerun of a forward at the same shape writes the same cache entries (same tokens, same
positions), so the reruns that price a new shape change nothing the engine sees.

Back-to-back reruns share the machine's state of that second, and this one drifts by 1.5x over
seconds: a table built in one pass priced a 1-row, 2-token verify 30% below the 1-token one
beside it. A pricing pass (`reprice`, `--reprice`) measures every shape it meets again and
keeps the faster price; after a few passes each price is the fastest of reruns minutes apart.

    python benchmarks/gamma_policy.py ... --clock virtual --prices P --reprice   # once or twice
    python benchmarks/gamma_policy.py ... --clock virtual --prices P             # the measurement

Even so, a price is an upper bound on its shape's cost (contention only adds), and some stay
high: one file priced 1-row verifies of 1..6 tokens at context 160 at 4.1, 6.1, 9.4, 5.6, 7.5,
7.3 ms, where interleaved reruns of the same forwards measure 4.5, 4.9, 5.0, 5.1, 5.4, 6.2
(docs/decisions.md, stop 38), and decisions at batch 1 followed the lucky shapes. So a forward
is charged the least price of any shape that does at least its work (as many rows or more, as
many tokens or more, as many keys or more: `monotone`), which is also an upper bound on its
cost; the file keeps the prices as measured. `--raw-prices` charges them as measured instead.

A `rule` (a function of the price key) prices new shapes instead of measuring them: a made-up
machine, for tests whose decisions must not follow this machine's load.

    VirtualClock(rule=lambda key: 5e-3 if key.startswith("target:") else 1e-5)

`cold_s` adds seconds to the first target forwards after a prefill, whatever their shape: on this
CPU a prefill evicts the weights from the caches, and the next three batch-1 steps took ~0.3,
~0.15 and ~0.07 ms (35%, 15%, 8%) more than later ones at any gamma (docs/decisions.md, stop 59).
A price table has no such state, so without it a virtual run cannot show what that does to a
policy that prices gammas by the steps it ran.

    VirtualClock.load(P, cold_s=(3e-4, 1.5e-4, 7e-5))
"""
from __future__ import annotations

import json
import math
import re
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

_real_perf_counter = time.perf_counter


def rows_bucket(n: int) -> int:
    """The bucket a batch of n rows is priced at: n up to 8, then the next of steps about 12%
    apart (10, 11, 12, 14, 15, 17, 19, 22, ...): 9 rows pay the price measured at 9 or 10."""
    return n if n <= 8 else int(8 * 1.12 ** math.ceil(math.log(n / 8, 1.12)))


def kv_bucket(kv: int) -> int:
    """Keys attended, in steps of 32 (64 from 512 on): attention is a small share of a step here."""
    step = 32 if kv < 512 else 64
    return -(-kv // step) * step


_SHAPE = re.compile(r"^(\w+):(?:(\d+):)?(\d+)x(\d+)(?:@(\d+))?$")


def _work(key: str):
    """(group, (rows, tokens, keys)) of a price key, or None: shapes of one group are ordered
    by the work they do. "target:48x3@96" -> (("target", None, None), (48, 3, 96)); a logits or
    draft key's second number is a width, not work: "logits:8x256" -> (("logits", None, 256), (8, 0, 0))."""
    m = _SHAPE.match(key)
    if m is None:
        return None
    kind, layer, rows, q, kv = m.groups()
    if kv is None:
        return (kind, layer, int(q)), (int(rows), 0, 0)
    return (kind, layer, None), (int(rows), int(q), int(kv))


def _at_least(work: tuple, than: tuple) -> bool:
    """Whether a shape of `work` (rows, tokens, keys) does at least the work of one of `than`."""
    return all(a >= b for a, b in zip(work, than))


def monotone(prices: dict[str, float]) -> dict[str, float]:
    """Each shape's price lowered to the least price of any shape of its group that does at
    least its work (more or as many rows, tokens and keys): measured prices only overstate, and a
    forward costs no more than a larger one. Keys that name no shape are kept as they are.
    Example: target 1x3@160 at 9.4 ms and 1x4@160 at 5.6 ms -> 1x3@160 at 5.6 ms."""
    groups = defaultdict(list)
    for key, price in prices.items():
        if (w := _work(key)) is not None:
            groups[w[0]].append((price, w[1], key))
    out = dict(prices)
    for members in groups.values():
        members.sort()                                  # cheapest first: the first larger shape is the least
        for _, work, key in members:
            out[key] = next(p for p, other, _ in members if _at_least(other, work))
    return out


def least_larger(key: str, price: float, table: dict[str, float]) -> float:
    """`monotone`'s price for one new shape against a table (whose prices stay as they are)."""
    w = _work(key)
    if w is None:
        return price
    group, work = w
    larger = [p for k, p in table.items() if (o := _work(k)) is not None and o[0] == group
              and _at_least(o[1], work)]
    return min(larger + [price])


class VirtualClock:
    def __init__(self, reps: int = 5, prices: dict | None = None, reprice: bool = False, raw: bool = False,
                 rule=None, cold_s: tuple[float, ...] = ()):
        self.reps = reps
        self.rule = rule           # key -> seconds: new shapes priced by it, not measured
        self.cold_s = tuple(cold_s)    # seconds added to the target forwards after a prefill (docstring)
        self._cold = len(self.cold_s)  # which of them the next target forward pays
        self.prices: dict[str, float] = dict(prices or {})   # as measured: what `save` writes
        self.raw = raw             # charge the prices as measured, not `monotone`'s
        self.charges: dict[str, float] = dict(self.prices) if raw else monotone(self.prices)
        self.reprice = reprice     # measure loaded shapes again at first sight, keep the faster price
        self._seen: set[str] = set()
        self.inside = 0.0          # real seconds spent in priced forwards
        self.charged = 0.0         # what they were charged
        self.measured = 0          # shapes priced by this clock (not loaded)
        self._depth = 0

    @classmethod
    def load(cls, path, reps: int = 5, reprice: bool = False, raw: bool = False,
             cold_s: tuple[float, ...] = ()) -> "VirtualClock":
        p = Path(path)
        return cls(reps, json.loads(p.read_text()) if p.exists() else None, reprice, raw, cold_s=cold_s)

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.prices, indent=0, sort_keys=True))

    def now(self) -> float:
        return _real_perf_counter() - self.inside + self.charged

    def priced(self, kind: str, fn, shape, prefill=None):
        """Wrap `fn(*args)`: its real time is taken out of the clock and `shape(*args)`'s price put in;
        `prefill(*args)`: whether the forward is a prefill, after which `cold_s` is charged."""
        def call(*args, **kwargs):
            if self._depth:                    # nested inside a priced call: the outer one pays
                return fn(*args, **kwargs)
            self._depth += 1
            try:
                t0 = _real_perf_counter()
                out = fn(*args, **kwargs)
                key = f"{kind}:{shape(*args, **kwargs)}"
                if key not in self.prices and self.rule is not None:
                    self.prices[key] = self.charges[key] = self.rule(key)
                elif key not in self.prices or (self.reprice and key not in self._seen):
                    times = [_real_perf_counter() - t0]
                    for _ in range(self.reps - 1):
                        t = _real_perf_counter()
                        fn(*args, **kwargs)
                        times.append(_real_perf_counter() - t)
                    self.prices[key] = min(times + [self.prices.get(key, math.inf)])
                    self.measured += 1
                    if key not in self.charges or self.raw:   # a new shape: its own price, or a larger shape's
                        self.charges[key] = self.prices[key] if self.raw else least_larger(
                            key, self.prices[key], self.charges)
                self._seen.add(key)
                self.inside += _real_perf_counter() - t0
                self.charged += self.charges[key]
                if prefill is not None and self.cold_s:
                    if prefill(*args, **kwargs):
                        self._cold = 0
                    elif self._cold < len(self.cold_s):
                        self.charged += self.cold_s[self._cold]
                        self._cold += 1
                return out
            finally:
                self._depth -= 1
        return call

    @contextmanager
    def installed(self):
        """Price every target and MTP-head forward (the classes', so engines built inside are
        priced too), and read time from this clock, until exit."""
        from pipeline.model.mtp import MTPHead
        from pipeline.model.target import TargetModel

        def target_shape(model, tokens, batch, cache=None):
            n, q = tokens.shape
            return f"{rows_bucket(n)}x{q}@{kv_bucket(batch.kv_len)}"

        def logits_shape(model, hidden):
            return f"{rows_bucket(hidden[..., 0].numel())}x{hidden.shape[-1]}"

        def head_shape(head, prev, next_ids, batch, cache=None, layer=0):
            n, q = next_ids.shape
            return f"{layer}:{rows_bucket(n)}x{q}@{kv_bucket(batch.kv_len)}"

        def draft_shape(head, out):
            return f"{rows_bucket(out[..., 0].numel())}x{out.shape[-1]}"

        def target_prefill(model, tokens, batch, cache=None):
            return batch.from_zero

        patched = [(TargetModel, "forward", "target", target_shape), (TargetModel, "logits", "logits", logits_shape),
                   (MTPHead, "forward", "head", head_shape), (MTPHead, "draft_logits", "draft", draft_shape)]
        originals = [(cls, name, cls.__dict__[name]) for cls, name, _, _ in patched]
        for cls, name, kind, shape in patched:
            setattr(cls, name, self.priced(kind, cls.__dict__[name], shape, target_prefill if kind == "target" else None))
        time.perf_counter = self.now
        try:
            yield self
        finally:
            time.perf_counter = _real_perf_counter
            for cls, name, fn in originals:
                setattr(cls, name, fn)


def add_clock_args(ap) -> None:
    """`--clock virtual [--prices FILE]` for a benchmark script (module docstring)."""
    ap.add_argument("--clock", choices=["real", "virtual"], default="real",
                    help="virtual: model forwards charged a fixed measured price per shape (pipeline/bench/virtual_clock.py)")
    ap.add_argument("--prices", type=Path, default=None,
                    help="with --clock virtual: prices to start from and to save back (same prices across runs)")
    ap.add_argument("--reprice", action="store_true",
                    help="with --prices: measure every shape met again and keep the faster price (a pricing "
                         "pass: its own timings mix prices from before and after)")
    ap.add_argument("--cold-ms", type=float, nargs="*", default=[],
                    help="with --clock virtual: milliseconds added to the first target forwards after each prefill "
                         "(this CPU's evicted caches: e.g. 0.3 0.15 0.07; pipeline.bench.virtual_clock)")
    ap.add_argument("--raw-prices", action="store_true",
                    help="with --clock virtual: charge each shape its price as measured, not the least price "
                         "of a shape doing at least its work (pipeline.bench.virtual_clock.monotone)")


@contextmanager
def clock_from_args(args):
    """The clock `args` ask for, installed for the block (a real clock: nothing changes). A
    virtual clock also points the profile cache at a new folder: a cached profile holds real
    times, which the prices would contradict."""
    if getattr(args, "clock", "real") != "virtual":
        yield None
        return
    import os
    import tempfile
    os.environ["SPECBATCH_CACHE"] = tempfile.mkdtemp(prefix="virtual-clock-")
    raw = getattr(args, "raw_prices", False)
    cold = tuple(ms / 1e3 for ms in getattr(args, "cold_ms", ()))
    clock = (VirtualClock.load(args.prices, reprice=args.reprice, raw=raw, cold_s=cold) if args.prices
             else VirtualClock(raw=raw, cold_s=cold))
    with clock.installed():
        yield clock
    if args.prices:
        clock.save(args.prices)
    print(f"virtual clock: {len(clock.prices)} shapes priced ({clock.measured} measured in this run); "
          f"forwards took {clock.inside:.1f} s real, charged {clock.charged:.1f} s")
