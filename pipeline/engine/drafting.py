"""One step's drafts over every source: which source each row takes and how many drafts.

The MTP gamma comes from the gamma policy as before (it prices the heads' cost); the n-gram
source proposes for every row at no model cost; each row then takes the source with more
expected accepted tokens within the heads' depth, and under `auto` the step keeps the drafts
that pay for their verify cost (pipeline.spec_decode.row_drafts); where no row keeps an n-gram
draft (a compute-bound batch, or heads that beat every match) the lookup pauses for a growing
number of steps, so its host time goes too. Under `auto`, a row that drafts with the heads may
also carry a *tail*: the n-gram continuation of its context followed by the heads' drafts, kept
where the expected tokens it adds (its acceptance given that every heads' draft was kept) pay for
the wider verify (`_add_tails`). With a fixed gamma every row drafts what its source has, up to
gamma. The result is one padded draft tensor with a count per row.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pipeline.engine.drafters import DraftRequest
from pipeline.spec_decode.policy import estimate_acceptance
from pipeline.spec_decode.acceptance import PAD, pad_mask
from pipeline.engine.verify import packs
from pipeline.spec_decode.row_drafts import (leading, acceptance_table, any_row_pays, cumulative, draft_lengths,
                                              kept, padded_lengths, rows_p, tail_lengths, takes_heads)
from pipeline.spec_decode.stats import SpecStats, _add_list_maps

MIN_GAIN = 0.05       # per-row drafts must predict this much over plain decoding (as GoodputPolicy.min_gain)
MAX_WAIT = 16         # where no n-gram draft pays, the lookup pauses 1, 3, 7, 15 steps (at most this - 1)
TAIL_MISSES = 3       # tails looked up without one kept, in a row, before their lookup pauses
TABLE_STEPS = 16      # steps between re-estimates of the n-gram acceptance table
GATHER_COST = 2.0     # a packed verify token costs about this many padded ones (cache gathers; measured on CPU)


@dataclass
class StepDrafts:
    drafts: torch.Tensor              # [n, G] PAD beyond draft_len
    draft_len: torch.Tensor | None    # [n]; None: every row drafts mtp_gamma (or none)
    probs: torch.Tensor | None        # [n, G, V] q of MTP rows (None: greedy, or no MTP row)
    one_hot: torch.Tensor | None      # [n] bool rows with deterministic (n-gram) drafts
    mtp_gamma: int                    # the heads drafted this many for every row (0: not run)
    use_mtp: torch.Tensor | None      # [n] bool rows taking the MTP drafts
    match: list[int] | None           # [n] n-gram match length (0: not an n-gram row)
    lookup_s: float = 0.0             # host-side drafting: the n-gram lookup (its own timing) and the per-row choice
    tail_len: list[int] | None = None     # [n] n-gram drafts after a heads row's mtp_gamma (its tail)
    tail_match: list[int] | None = None   # [n] the tail's match length

    @property
    def by_gamma(self) -> bool:
        """Every row drafted mtp_gamma with the heads and nothing more, or none drafted: a step
        of one gamma's shape, verified as one (the cost model's per-gamma correction takes it).
        Plans with a count per row are not: some rows drafted less, or their verify was packed."""
        return self.draft_len is None


def empty_drafts(n: int, device, lookup_s: float = 0.0) -> StepDrafts:
    return StepDrafts(torch.zeros(n, 0, dtype=torch.long, device=device), None, None, None, 0, None, None, lookup_s)


def width_costs(model, rows: int, ctx: float, width: int) -> list[float]:
    """Step seconds of a padded verify at each width 0..`width`: a plain step plus what a
    verify of w + 1 tokens per row costs over a 1-token one, each priced as measured at its
    shape where it has been (VerifyCorrection), made non-decreasing (`nondecreasing`: a verify
    of more tokens does not cost less; measured medians of neighbouring widths sometimes say it
    does, and a planner would then pick the width that was lucky). Example: plain 40 ms,
    verifies of 1 / 2 / 3 tokens 42 / 55 / 80 ms -> [40, 53, 78]."""
    base = model.step_s(rows, 0, ctx)
    v = nondecreasing([model.measured_verify_s(rows, q, ctx) for q in range(1, width + 2)])
    return [base] + [base + x - v[0] for x in v[1:]]          # pooled: never below v[0]


def nondecreasing(xs: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of xs (pool adjacent violators): each run of values
    that decreases is replaced by its mean. Example: [4.7, 5.2, 6.8, 6.4, 8.2, 7.1] ->
    [4.7, 5.2, 6.6, 6.6, 7.65, 7.65]."""
    blocks: list[list[float]] = []              # [sum, count] per pooled run
    for x in xs:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return [s / c for s, c in blocks for _ in range(int(c))]


def token_cost(costs: list[float], first_s: float, rows: int) -> float:
    """From `width_costs`: the mean cost of one more verified token over the widest width, less
    the fixed extra `first_s` of a multi-token verify (the secant: verify cost bends where the
    batch turns compute-bound). Example: [40, 53, 78] ms, first 1 ms, 4 rows: (38 - 1) / 8."""
    width = len(costs) - 1
    return max(costs[width] - costs[0] - first_s, 0.0) / (rows * width)


class Backoff:
    """Steps to skip a lookup whose drafts did not pay: after `grace` misses in a row it pauses
    1, 3, 7, 15 steps (at most MAX_WAIT - 1), and a hit ends the pause.
    Example, grace 0: miss, miss -> the next 1, then 3 steps skip; a hit -> none skip."""

    def __init__(self, grace: int = 0):
        self.grace, self.idle, self.wait = grace, 0, 0

    def skip(self) -> bool:
        """This step skips the lookup (and counts down the pause)."""
        if self.wait > 0:
            self.wait -= 1
            return True
        return False

    def miss(self) -> None:
        self.idle += 1
        self.wait = min(2 ** max(self.idle - self.grace, 0), MAX_WAIT) - 1

    def hit(self) -> None:
        self.idle = 0


class DraftPlanner:
    def __init__(self, sources, auto: bool, ngram_cap: int, evidence: SpecStats, cost_model, params,
                 layout: str = "auto"):
        """`evidence`: earlier n-gram acceptance of this task (the engine's); `cost_model`: a
        callable returning the engine's CostModel or None."""
        self.sources, self.auto, self.ngram_cap = sources, auto, ngram_cap
        self.evidence, self.cost_model, self.params = evidence, cost_model, params
        self.layout = layout              # the verify layout (pipeline.engine.verify): what to price
        self._table, self._asked, self._table_version = None, 0, 0
        self._may_pay: dict[tuple, bool] = {}        # (rows, context bucket, model, table) -> `_lookup_may_pay`
        self._pause = Backoff()                      # the per-row lookup, where no n-gram draft pays
        self._tail_pause = Backoff(TAIL_MISSES)      # the heads rows' tails, likewise

    def plan(self, n: int, lengths, rows, mtp_gamma: int, pick, stats: SpecStats, mtp_prior: SpecStats | None,
             ctx: float, measuring: bool) -> StepDrafts:
        """`measuring`: the gamma policy calibrates the heads or measures plain decoding this
        step, so no n-gram drafts (they would take rows from the heads' evidence or the price).
        The per-row choice is host math on lists (pipeline.spec_decode.row_drafts)."""
        dev = lengths.device
        mtp, ngram = self.sources.get("mtp"), self.sources.get("ngram")
        ng, looked = None, 0.0
        if (ngram is not None and self.ngram_cap > 0 and not measuring and not self._pause.skip()
                and (mtp_gamma > 0 or self._lookup_may_pay(n, ctx, stats))):
            ng = ngram.propose(DraftRequest(n, lengths, self.ngram_cap, pick, rows))
            looked = ng.seconds
            if not any(ng.match):
                ng = None
        if ng is None:
            if mtp is None or not mtp_gamma or measuring or not self._tails_possible():
                return self._mtp_only(n, lengths, rows, mtp_gamma, pick, looked)     # no n-gram tails either
            return self._heads_step(n, lengths, rows, mtp_gamma, pick, looked,
                                    self._heads_cum(stats, mtp_prior, mtp_gamma), stats, ctx)
        t_choice = time.perf_counter()            # the per-row choice is host work n-gram drafting needs
        g = ng.drafts.shape[1]
        avail = ng.host_len if ng.host_len is not None else ng.draft_len.tolist()
        cum = self._ngram_cum(stats, g)
        p_ng = [rows_p(cum[m], a) for m, a in zip(ng.match, avail)]          # [n][G]
        use_mtp, ng_lens = [False] * n, None
        cum_mtp = [0.0]
        if mtp is not None and mtp_gamma > 0:     # the policy found the heads pay: rows they beat take them
            cum_mtp = self._heads_cum(stats, mtp_prior, mtp_gamma)
            p_mtp = sum(cum_mtp)
            use_mtp = [takes_heads(r, p_mtp, mtp_gamma) for r in p_ng]
            if self.auto and any(use_mtp):
                pay, ng_lens = self._heads_pay(p_ng, use_mtp, p_mtp, mtp_gamma, n, ctx)
                if not pay:
                    use_mtp = [False] * n
            p_ng = [[0.0] * g if u else r for r, u in zip(p_ng, use_mtp)]
        if ng_lens is None:
            ng_lens = self._lengths(p_ng, n, ctx) if self.auto else avail
        lens = [mtp_gamma if u else k for u, k in zip(use_mtp, ng_lens)]
        looked += time.perf_counter() - t_choice
        if any(k for k, u in zip(lens, use_mtp) if not u):
            self._pause.hit()
        else:                             # no n-gram draft kept: look again after a growing pause
            self._pause.miss()
            if not any(lens):
                return self._mtp_only(n, lengths, rows, mtp_gamma, pick, looked)
            if all(use_mtp):              # every row takes the heads: a gamma's step (and its tails)
                return self._heads_step(n, lengths, rows, mtp_gamma, pick, looked, cum_mtp, stats, ctx)
        width = max(lens)
        drafts = ng.drafts[:, :width]
        if width > g:
            drafts = torch.cat([drafts, torch.full((n, width - g), PAD, dtype=torch.long, device=dev)], dim=1)
        lens_t = torch.tensor(lens, device=dev)
        probs, ran = None, 0
        if any(use_mtp):
            prop = mtp.propose(DraftRequest(n, lengths, mtp_gamma, pick, rows))
            ran = mtp_gamma
            um = torch.tensor(use_mtp, device=dev)
            drafts = drafts.clone()
            drafts[um, :mtp_gamma] = prop.drafts[um]
            drafts[um, mtp_gamma:] = PAD
            if prop.probs is not None:
                probs = prop.probs.new_zeros(n, width, prop.probs.shape[-1])
                probs[:, :mtp_gamma] = prop.probs
        else:
            um = torch.zeros(n, dtype=torch.bool, device=dev)
            if mtp is not None:
                mtp.skip()
        if any(k < min(a, width) for k, a, u in zip(lens, avail, use_mtp) if not u):   # rows cut short
            drafts = torch.where(pad_mask(lens_t, width), drafts, PAD)
        match_list = [m if not u and k else 0 for m, u, k in zip(ng.match, use_mtp, lens)]
        plan = StepDrafts(drafts, lens_t, probs, ~um, ran, um, match_list, looked)
        if ran and self.auto:
            base = n + sum(use_mtp) * sum(cum_mtp) + kept(p_ng, [0 if u else k for u, k in zip(use_mtp, lens)])
            plan = self._add_tails(plan, rows, use_mtp, lens, base, cum_mtp[-1], stats, n, ctx)
        return plan

    def _lookup_may_pay(self, n: int, ctx: float, stats: SpecStats) -> bool:
        """Whether n-gram drafts could pay at this shape where the heads do not run: False where
        even every row matching at the best length with a full proposal keeps no draft, under
        either verify layout (each row's P is at most that row's, so neither pricing keeps more
        for real rows): at a compute-bound batch a verified token costs what an emitted one
        does, and the lookup's host time (~0.5 ms at 48 rows) would be spent for nothing.
        Asked once per shape and cost model (the acceptance table moves slowly); True without
        `auto` or a cost model. A pause (`Backoff`) counts down only on steps that could look up.
        Example, 48 rows on the demo's CPU, best P_1 0.8: a 2-token verify costs 1.9x a plain
        step, so width 1 makes (48 + 48 x 0.8) / 1.9 = 45 tokens in a plain step's time against
        48, and packed drafts (~2 tokens' cost each) gain less still: no lookup. At 4 rows a
        2-token verify costs 1.3x: (4 + 3.2) / 1.3 = 5.5 against 4: looked up."""
        model = self.cost_model() if self.auto else None
        if model is None:
            return True
        shape = (n, int(ctx) // 64, id(model))
        may = self._may_pay.get((*shape, self._table_version))
        if may is None:
            cum = self._ngram_cum(stats, self.ngram_cap)      # may re-estimate the table: keyed after it
            best = [max(c[j] for c in cum) for j in range(len(cum[0]))]
            costs = width_costs(model, n, ctx, len(best))
            token = token_cost(costs, model.multi_token_s, n)
            may = any_row_pays(best, n, costs, token * GATHER_COST, model.multi_token_s, MIN_GAIN)
            if len(self._may_pay) >= 256:
                self._may_pay.clear()
            self._may_pay[(*shape, self._table_version)] = may
        return may

    def _heads_step(self, n: int, lengths, rows, gamma: int, pick, looked: float, cum: list[float],
                    stats: SpecStats, ctx: float) -> StepDrafts:
        """Every row drafts `gamma` with the heads, one gamma's uniform step, with n-gram tails
        where they pay (`_add_tails`); `cum`: the heads' cumulative acceptance P_1..P_gamma."""
        plan = self._mtp_only(n, lengths, rows, gamma, pick, looked)
        return self._add_tails(plan, rows, [True] * n, [gamma] * n, n + n * sum(cum), cum[-1], stats, n, ctx)

    def _heads_cum(self, stats: SpecStats, mtp_prior: SpecStats | None, gamma: int) -> list[float]:
        """The heads' cumulative acceptance P_1..P_gamma, from this call's counts and the prior."""
        reached = _sum(stats.reached, mtp_prior.reached if mtp_prior else [])
        accepted = _sum(stats.accepted, mtp_prior.accepted if mtp_prior else [])
        return cumulative(estimate_acceptance(reached, accepted, gamma))

    def _add_tails(self, plan: StepDrafts, rows, use_mtp: list[bool], lens: list[int], base: float,
                   p_all: float, stats: SpecStats, n: int, ctx: float) -> StepDrafts:
        """The heads rows' n-gram tails (module docstring), where they pay: each heads row looks up
        the continuation of its context and its drafts, a tail draft j is kept with P = p_all
        (every heads' draft kept) x the n-gram acceptance at its match length, and the step's
        width W >= its current one maximises expected tokens per second of the whole step
        (`tail_lengths`; `base`: the step's expected tokens without tails). Needs `auto`, the
        n-gram source and a cost model; where no tail pays the lookup pauses as `plan`'s does.
        Example, batch 1, gamma 5, p_all 0.68, a 3-token match kept at 0.6 then 0.5: tail P
        [0.41, 0.20]; on a step expecting 4.9 tokens the first adds 8%, the second 4%, so each
        is kept where widening the verify by one token costs less than that share of the step."""
        if not self._tails_possible() or p_all <= 0:
            return plan
        ngram, model, g = self.sources.get("ngram"), self.cost_model(), plan.mtp_gamma
        if model is None:
            return plan
        if self._tail_pause.skip():
            return plan
        t0 = time.perf_counter()
        heads = plan.drafts[:, :g].tolist()
        tails, match = ngram.tails([r if u else None for r, u in zip(rows, use_mtp)], heads, self.ngram_cap)
        p_tail = []
        if any(match):
            cum = self._ngram_cum(stats, self.ngram_cap)
            p_tail = [[p_all * x for x in rows_p(cum[m], len(t))] if m else [] for t, m in zip(tails, match)]
            width = max(lens)
            costs = width_costs(model, n, ctx, g + self.ngram_cap)       # verify at each width ...
            step = model.step_s(n, g, ctx) - costs[g]                      # ... plus the rest of a gamma-g step
            tail = tail_lengths(p_tail, width, g, base, [step + max(c, costs[g]) for c in costs])
        if not p_tail or not any(tail):            # a tail needs the heads' drafts to match: a few misses
            self._tail_pause.miss()                # are the drafts', more a source that does not pay here
            plan.lookup_s += time.perf_counter() - t0
            return plan
        self._tail_pause.hit()
        dev = plan.drafts.device
        lens = [k + t for k, t in zip(lens, tail)]
        width = max(lens)
        drafts = torch.full((n, width), PAD, dtype=torch.long, device=dev)
        drafts[:, :plan.drafts.shape[1]] = plan.drafts
        cols = [(i, g + j, tok) for i, (t, k) in enumerate(zip(tails, tail)) for j, tok in enumerate(t[:k])]
        rows_i, cols_j, toks = zip(*cols)
        drafts[list(rows_i), list(cols_j)] = torch.tensor(toks, dtype=torch.long, device=dev)
        um = torch.tensor(use_mtp, device=dev)
        one_hot = (~um)[:, None] | (torch.arange(width, device=dev) >= g)          # [n, W]: q one-hot
        probs = plan.probs
        if probs is not None and probs.shape[1] < width:
            probs = torch.cat([probs, probs.new_zeros(n, width - probs.shape[1], probs.shape[-1])], dim=1)
        return StepDrafts(drafts, torch.tensor(lens, device=dev), probs, one_hot, g, um,
                          plan.match or [0] * n, plan.lookup_s + time.perf_counter() - t0,
                          tail, [m if t else 0 for m, t in zip(match, tail)])

    def _tails_possible(self) -> bool:
        """Heads rows may get n-gram tails: `auto`, with an n-gram source allowed to draft."""
        return self.auto and self.sources.get("ngram") is not None and self.ngram_cap > 0

    def _mtp_only(self, n: int, lengths, rows, mtp_gamma: int, pick, looked: float = 0.0) -> StepDrafts:
        """Every row drafts mtp_gamma with the heads (or nobody drafts): the step as before n-grams.
        `looked`: the host seconds of a lookup (and choice) that found nothing worth drafting."""
        mtp = self.sources.get("mtp")
        if mtp is None or mtp_gamma == 0:
            if mtp is not None:
                mtp.skip()
            return empty_drafts(n, lengths.device, looked)
        prop = mtp.propose(DraftRequest(n, lengths, mtp_gamma, pick, rows))
        return StepDrafts(prop.drafts, None, prop.probs, None, mtp_gamma, None, None, looked)

    def _ngram_cum(self, stats: SpecStats, depth: int) -> list[list[float]]:
        """Per match length, the cumulative acceptance P_j of an n-gram draft's first `depth`,
        re-estimated every TABLE_STEPS steps (it moves slowly, and rebuilding it is a good part
        of a small batch's drafting time)."""
        self._asked += 1
        if self._table is None or len(self._table[0]) < depth or self._asked % TABLE_STEPS == 0:
            ev = self.evidence or SpecStats()
            table = acceptance_table(_add_list_maps(ev.source_reached, stats.source_reached),
                                     _add_list_maps(ev.source_accepted, stats.source_accepted), "ngram",
                                     max(depth, self.ngram_cap))
            self._table = [cumulative(a) for a in table]
            self._table_version += 1
        return [c[:depth] for c in self._table] if len(self._table[0]) > depth else self._table

    def _heads_pay(self, p_ng: list[list[float]], use_mtp: list[bool], p_mtp: float, gamma: int, n: int,
                   ctx: float) -> tuple[bool, list[int] | None]:
        """Whether running the heads this step, for the rows where they expect more tokens than
        their n-gram drafts, predicts more goodput than the n-gram drafts alone; with the n-gram
        rows' draft lengths of the option it picks (None: no cost model, the heads run). The
        heads cost their depth for the step whichever rows take them (the locally measured price
        of a gamma step), n-gram drafts only their verify; once the heads run, a row takes the
        source with more expected tokens. Example, batch 1: heads 2.0 expected drafts at 2.5x a
        plain step, n-grams 1.1 at 1.3x: (1 + 2.0) / 2.5 = 1.2 < (1 + 1.1) / 1.3 = 1.6: n-grams."""
        model = self.cost_model()
        if model is None:
            return True, None
        g = len(p_ng[0])
        costs = width_costs(model, n, ctx, g)
        token = token_cost(costs, model.multi_token_s, n)
        alone = self._lengths(p_ng, n, ctx, costs)
        gp_alone = (n + kept(p_ng, alone)) / costs[max(alone)]
        rest = [[0.0] * g if u else r for r, u in zip(p_ng, use_mtp)]
        lens = self._lengths(rest, n, ctx, costs)
        wider = max(max(lens) - gamma, 0)                    # n-gram rows drafting past the heads' depth
        gp_heads = ((n + sum(use_mtp) * p_mtp + kept(rest, lens))
                    / (model.step_s(n, gamma, ctx) + n * wider * token))
        return (True, lens) if gp_heads > gp_alone else (False, alone)

    def _lengths(self, p: list[list[float]], n: int, ctx: float, costs: list[float] | None = None) -> list[int]:
        """Drafts per row for P [n][G] by the verify layout; `costs`: `width_costs` at this
        step's shape and width G, where the caller has them already."""
        model = self.cost_model()
        if model is None:
            return [leading(r) for r in p]
        g = len(p[0])
        costs = costs or width_costs(model, n, ctx, g)
        base, first = costs[0], model.multi_token_s
        token = token_cost(costs, first, n)
        if self.layout == "packed":
            return draft_lengths(p, base, token * GATHER_COST, first, MIN_GAIN)
        padded = padded_lengths(p, costs, MIN_GAIN)
        if self.layout == "padded":
            return padded
        if not packs(sum(r[0] > 0 for r in p) * g, n, g):
            return padded                  # too many rows have drafts for a packed verify
        ragged = draft_lengths(p, base, token * GATHER_COST, first, MIN_GAIN)
        width = max(ragged)                # auto: ragged where the verify will be packed and it predicts more
        if width and packs(sum(ragged), n, width):
            gp_r = (n + kept(p, ragged)) / (base + first + sum(ragged) * token * GATHER_COST)
            gp_p = (n + kept(p, padded)) / costs[max(padded)]
            if gp_r > gp_p:
                return ragged
        return padded


def _sum(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
