"""Per-row draft source and length: expected accepted tokens per unit of verify cost.

Each row i has, from each source, a proposal of avail_i drafts whose j-th is kept with
probability P_ij = prod_{k<=j} a_k (a_k: that source's measured per-depth acceptance, for an
n-gram draft at its match length). A row takes the source with the larger expected accepted
tokens sum_j P_ij within the heads' depth (`takes_heads`). Then over all rows at once, with a ragged verify costing

    step_s(D) = base_s + [D > 0] * first_s + D * token_s          (D: drafts in the step)

the step keeps the D drafts of largest P (a row's P falls with depth, so that is a prefix of
each row) for the D that maximises goodput (rows + sum of kept P) / step_s(D), or none where
that is within `min_gain` of plain decoding.

`padded_lengths` prices a padded verify instead (its cost is the widest row's, for every row),
from the step's measured cost at each width.

Example: 2 rows, P = [[0.9, 0.8], [0.2, 0.0]], base_s 10, first_s 0, token_s 1: keeping
0.9, 0.8 gives (2 + 1.7) / 12 = 0.308 tokens/s-unit against 2 / 10 = 0.2, adding 0.2 gives
3.9 / 13 = 0.300: lengths [2, 0].

Host math on a step's few numbers, in plain Python lists: a torch or numpy call costs 10-100 us
between a step's forwards on this CPU, and a batch-1 step's choice took 0.7 ms of a 5 ms step in
torch (docs/decisions.md, 2026-12-02). P is a list of rows, lengths a list of ints.
"""
from __future__ import annotations

from itertools import accumulate

from pipeline.spec_decode.policy import estimate_acceptance

MATCH_PRIOR = {1: 0.3, 2: 0.5, 3: 0.7}     # a_1 prior of an n-gram draft by match length


def acceptance_table(reached: dict[str, list[int]], accepted: dict[str, list[int]], prefix: str,
                     depth: int, max_match: int = 3) -> list[list[float]]:
    """[max_match + 1][depth] per-depth acceptance of `prefix:m` drafts (row m; row 0 all zero),
    from counts keyed "ngram:1".. with a Beta prior (MATCH_PRIOR)."""
    return [[0.0] * depth] + [estimate_acceptance(reached.get(f"{prefix}:{m}", []), accepted.get(f"{prefix}:{m}", []),
                                                  depth, prior_mean=MATCH_PRIOR.get(m, 0.5))
                              for m in range(1, max_match + 1)]


def cumulative(acceptance: list[float]) -> list[float]:
    """P_j = prod_{k<=j} a_k. Example: [0.5, 0.5, 0.5] -> [0.5, 0.25, 0.125]."""
    return list(accumulate(acceptance, lambda p, a: p * a))


def rows_p(cum: list[float], avail: int) -> list[float]:
    """One row's P from its source's cumulative acceptance (`cumulative`), zero beyond its
    proposal's `avail` drafts. Example: cumulative([0.5, 0.5, 0.5]), avail 2 -> [0.5, 0.25, 0]."""
    return cum[:avail] + [0.0] * (len(cum) - avail)


def kept(p: list[list[float]], lens: list[int]) -> float:
    """Expected accepted drafts when row i keeps its first lens[i]."""
    return sum(sum(row[:k]) for row, k in zip(p, lens))


def takes_heads(row: list[float], p_mtp: float, gamma: int) -> bool:
    """Whether a row drafts with the heads (expected kept drafts `p_mtp` at depth `gamma`) rather
    than its n-gram proposal (P `row`), compared at the heads' depth: drafts past it widen the
    verify, which the step's pricing weighs for every row at once (DraftPlanner._heads_pay,
    _lengths); counted as free, a long weak match took rows from better heads.
    Example: heads 1.8 at gamma 3; n-gram P [0.5, 0.4, 0.3, 0.3, 0.3]: 1.2 within 3 (1.8 in all):
    the heads."""
    return sum(row[:gamma]) < p_mtp


def leading(row: list[float]) -> int:
    """Drafts with P > 0 (a prefix: P falls with depth)."""
    k = 0
    for x in row:
        if x <= 0:
            break
        k += 1
    return k


def draft_lengths(p: list[list[float]], base_s: float, token_s: float, first_s: float = 0.0, min_gain: float = 0.0) -> list[int]:
    """P [n][G] -> drafts to verify per row [n] (module docstring); rows with P 0 get 0."""
    n = len(p)
    flat = sorted(((x, i) for i, row in enumerate(p) for x in row if x > 0), key=lambda t: -t[0])
    if not flat:
        return [0] * n
    best, best_gp, total = -1, (1 + min_gain) * n / base_s, float(n)
    for k, (x, _) in enumerate(flat):
        total += x
        gp = total / (base_s + first_s + token_s * (k + 1))
        if gp > best_gp:
            best, best_gp = k, gp
    lens = [0] * n
    for _, i in flat[:best + 1]:
        lens[i] += 1                       # a row's P falls with depth: its kept drafts are a prefix
    return lens


def padded_lengths(p: list[list[float]], costs: list[float], min_gain: float = 0.0) -> list[int]:
    """Drafts per row when every row verifies W + 1 slots (a padded verify prices the width,
    not the drafts): `costs[W]` the step's seconds at width W (0: plain), W maximises
    (rows + sum_{j<W} P_ij) / costs[W], and each row drafts what it has below W.
    Example: P [[0.9, 0.8], [0.2, 0]], costs [10, 12, 14]: W=1: 3.1 / 12 = 0.26, W=2: 3.9 / 14 =
    0.28, plain 2 / 10 -> W=2, lengths [2, 1]."""
    n = len(p)
    if n == 0 or not p[0]:
        return [0] * n
    best, best_gp = 0, (1 + min_gain) * n / costs[0]
    for w, gain in enumerate(accumulate(sum(col) for col in zip(*p)), start=1):
        gp = (n + gain) / costs[w]
        if gp > best_gp:
            best, best_gp = w, gp
    return [min(leading(row), best) for row in p]


def tail_lengths(p_tail: list[list[float]], width: int, gamma: int, base: float, costs: list[float]) -> list[int]:
    """Tail drafts per row after the heads' `gamma` (pipeline.engine.drafting), for a padded
    verify: the step is `width` wide already (width >= gamma), costs[W] is its seconds at width
    W, and a row keeps its tail's first W - gamma drafts (P `p_tail[i]`, [] for no tail). W
    maximises (base + kept tail P) / costs[W]: a tail within the current width is free.
    Example: gamma 2, width 2, base 3.0, p_tail [[0.5, 0.4, 0.1]], costs [.., 1.0 (W=2), 1.05,
    1.1, 1.4]: W=3: 3.5 / 1.05 = 3.33, W=4: 3.9 / 1.1 = 3.55, W=5: 4.0 / 1.4: lengths [2]."""
    best_w, best = width, (base + sum(sum(t[:width - gamma]) for t in p_tail)) / costs[width]
    for w in range(width + 1, len(costs)):
        gp = (base + sum(sum(t[:w - gamma]) for t in p_tail)) / costs[w]
        if gp > best:
            best_w, best = w, gp
    return [min(leading(t), best_w - gamma) for t in p_tail]


def any_row_pays(best: list[float], n: int, costs: list[float], token_s: float, first_s: float = 0.0,
                 min_gain: float = 0.0) -> bool:
    """Whether n rows that all had P `best` [G] would keep any draft under `padded_lengths` (costs)
    or `draft_lengths` (costs[0] as base_s, token_s, first_s): what those give on [best] * n,
    worked out per depth instead of over n x G entries. Rows whose P is at most `best` keep
    none where this is False (either pricing's goodput only falls as P does).
    Padded at width W: (n + n S_W) / costs[W], S_W = sum_{j<W} best_j. Ragged: the k largest P
    are whole depths of n rows, then part of the next; within a depth goodput over k is a ratio
    of linear functions, monotone, so it peaks at a depth's end (its start is the last depth's
    end plus drafts that each gain less than the mean, or k = 0: plain decoding, with
    first_s >= 0).
    Example: best [0.8], n 48, costs [12, 23] ms, token 0.24 ms, first 0: padded 86.4 / 23 = 3.8
    and ragged 86.4 / (12 + 48 x 0.24) = 3.7, both under plain decoding's 48 / 12 = 4: False."""
    if n == 0 or not best:
        return False
    bar = (1 + min_gain) / costs[0]                       # tokens a second per row that plain decoding makes
    total = 1.0
    for w, x in enumerate(best, start=1):
        total += x
        if w < len(costs) and total / costs[w] > bar:
            return True
    bar *= n
    base, total = costs[0], float(n)
    for k, x in enumerate(best, start=1):
        if x <= 0:
            break
        total += n * x
        if total / (base + first_s + token_s * n * k) > bar:
            return True
    return False
