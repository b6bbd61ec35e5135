"""One `Engine.generate` call: the batched speculative decoding loop with continuous batching.

One iteration (`_step`): admit queued rows into free slots (batched prefills of prompts of
similar length, `prefill_groups`), choose gamma, draft (each row from its own source, with its
own number of drafts: pipeline.engine.drafting), verify last token + drafts in one target
forward for every active row, accept per row, emit. Each row advances by its own acceptance
length; rejected drafts are rolled back by not advancing its length.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from pipeline.engine.coupled import CoupledDraftPick, CoupledSampler
from pipeline.engine.drafters import TaskIndex
from pipeline.engine.drafting import DraftPlanner, StepDrafts
from pipeline.engine.emit import emit_ragged, emit_uniform
from pipeline.engine.verify import choose_layout, greedy_verify, uniform_verify, verify_forward
from pipeline.engine.params import SamplingParams
from pipeline.engine.warm_start import ensure_profile
from pipeline.engine.rows import Row
from pipeline.engine.slots import Slots
from pipeline.model import native
from pipeline.model.cache import Batch
from pipeline.spec_decode import rng
from pipeline.spec_decode.acceptance import coupled_accept, greedy_accept, rejection_sample, rejection_sample_ragged
from pipeline.spec_decode.policy import FEW_ROWS, GammaPolicy, GoodputPolicy, StepContext
from pipeline.spec_decode.sampling import GREEDY_PICK, filtered_probs, sample
from pipeline.spec_decode.stats import PrefillRecord, SpecStats, StepRecord

if TYPE_CHECKING:
    from pipeline.engine.engine import Engine

TASK_INDEX_TOKENS = 32768   # output tokens an engine keeps per task for n-gram drafting
OUTPUT_LENGTHS = 64         # finished rows' output lengths an engine keeps per task (the policy's typical length)
PAD_SLACK = 1.25        # a prefill forward computes at most this many (padded) tokens per prompt token


def prefill_groups(lengths: list[int], slack: float = PAD_SLACK) -> list[list[int]]:
    """Indices of prompts to admit, grouped by length, one prefill forward per group: padding a
    batch to its longest prompt computes tokens that are thrown away (most of them, where prompt
    lengths vary tenfold). Ascending, a group grows
    while rows x its longest prompt stays within `slack` x its real tokens.
    Example: [5, 100, 6, 90] -> [[0, 2], [3, 1]]."""
    groups, group, real = [], [], 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if group and (len(group) + 1) * lengths[i] > slack * (real + lengths[i]):
            groups.append(group)
            group, real = [], 0
        group.append(i)
        real += lengths[i]
    return groups + [group] if group else groups


def expected_left(ascending: list, have: int, left: int) -> float:
    """Tokens a row that has `have` output tokens is expected to produce still, from recent
    finished rows' output lengths (`ascending`, sorted): the median of L - have over the rows
    that ran longer than it (a row's remaining length given that it got this far), within its
    budget `left`; its budget where no row has finished; 1 where no recent row ran longer (it
    may end any step). One bisect a row: the policy asks for every row with a waiting fill.
    Example: lengths [10, 20, 40, 64, 64], have 30: the rows past 30 had 10, 34, 34 left, so
    34 (the plain median less what it has would say 10, and 1 past 40)."""
    if not ascending:
        return max(left, 1)
    lo = bisect.bisect_right(ascending, have)
    k = len(ascending) - lo                     # rows that ran longer; their lengths are sorted already
    if not k:
        return 1
    mid = lo + k // 2
    median = ascending[mid] if k % 2 else (ascending[mid - 1] + ascending[mid]) / 2
    return max(min(left, median - have), 1)


class GenerateRun:
    """State of one generate() call: slots, caches, queue, draft sources."""

    def __init__(self, engine: Engine, rows: list[Row], params: SamplingParams, policy: GammaPolicy,
                 sources: tuple = ("mtp",), gamma=None, task: str | None = None):
        """`sources`: the draft sources (resolve_draft); `gamma`: the caller's gamma (default: the
        policy); defaults draft with the heads under `policy` alone."""
        self.e, self.params, self.policy = engine, params, policy
        gamma = policy if gamma is None else gamma
        cfg = engine.config
        self.auto = gamma == "auto" or isinstance(gamma, GoodputPolicy)
        self.mtp_cap = (min(engine.gamma_max, policy.max_gamma())
                        if "mtp" in sources and "mtp" in engine.draft_names else 0)
        ngram_cap = 0
        if "ngram" in sources:
            ngram_cap = engine.gamma_max if gamma == "auto" else gamma.max_gamma() if hasattr(gamma, "choose") else int(gamma)
        # widest verify: n-gram rows to ngram_cap, heads rows to mtp_cap plus an n-gram tail under auto
        self.gamma_cap = self.mtp_cap + ngram_cap if self.auto and self.mtp_cap else max(self.mtp_cap, ngram_cap)
        batch = min(engine.max_batch_size, len(rows))
        capacity = max(len(r.prompt_ids) + r.max_new for r in rows) + self.gamma_cap + 2
        self.cache = engine.kv_cache("target", cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        names = [name for name, cap in (("mtp", self.mtp_cap), ("ngram", ngram_cap)) if cap > 0]
        index = engine.task_indexes.setdefault(task, TaskIndex(TASK_INDEX_TOKENS)) if ngram_cap > 0 else None
        self.sources = engine.draft_sources(batch, capacity, names, index, coupled=params.coupled, held_cache=True)
        if ngram_cap > 0 and self.auto:          # the per-row choice prices drafts by the cost model
            ensure_profile(engine, rows=batch, explore=self.mtp_cap > 0)
        self.planner = None
        if self.sources is not None:
            evidence = engine.ngram_evidence.get(task)
            self.planner = DraftPlanner(self.sources, self.auto, ngram_cap, evidence, engine.cost_model, params,
                                        engine.verify_layout)
        self.task = task
        # finished rows' output lengths: the task's, kept by the engine across calls, else this call's
        self.lengths = (engine.output_lengths.setdefault(task, deque(maxlen=OUTPUT_LENGTHS)) if task is not None
                        else deque(maxlen=OUTPUT_LENGTHS))
        self.slots = Slots(batch, engine.device, self.sources, self.cache)
        self.queue = deque(rows)
        self.admitted = False         # rows were admitted since the policy last chose (GoodputPolicy.plain_stands)
        self.after_prefill = -1       # steps since every active row was admitted at once (StepRecord.after_prefill)
        self.eos = frozenset(cfg.eos_token_ids)
        self.stats = engine.last_stats
        # its steps count towards cost-model refits: the gamma policy or the per-row choice prices by it
        self.refine = isinstance(policy, GoodputPolicy) or (self.auto and ngram_cap > 0)
        self.coupled = (CoupledSampler(params.seed, filtered=params.top_k > 0 or params.top_p < 1,
                                       noise=native.exponential_noise)
                        if params.coupled else None)

    def run(self) -> None:
        while self.queue or self.slots.n:
            self._admit()
            self._step()
        if self.sources is not None and self.sources.get("ngram") is not None:
            st = self.stats
            ev = self.e.ngram_evidence.get(self.task) or SpecStats()
            self.e.ngram_evidence[self.task] = ev.merge(SpecStats(source_reached=st.source_reached,
                                                                  source_accepted=st.source_accepted))

    # ---- admission: batched prefill of queued rows into free slots ----------------------------
    def _admit(self) -> None:
        admitted = 0
        while self.queue and (free := self.slots.free_slots()):
            take = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
            for group in prefill_groups([len(r.prompt_ids) for r in take]):
                self._prefill([free[i] for i in group], [take[i] for i in group])
            admitted += len(take)
        self.slots.compact()                           # rows may finish at once: the loop refills
        if admitted and admitted >= self.slots.n:      # the whole batch is new: its next steps run cold
            self.after_prefill = 0                     # (pipeline.spec_decode.cost.COLD_STEPS)

    def _prefill(self, slot_ids: list[int], rows: list[Row]) -> None:
        t0 = time.perf_counter()
        dev = self.e.device
        lens = torch.tensor([len(r.prompt_ids) for r in rows], device=dev)
        width = int(lens.max())
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
        for i, r in enumerate(rows):
            ids[i, :len(r.prompt_ids)] = torch.tensor(r.prompt_ids)
        slots = torch.tensor(slot_ids, device=dev)
        hidden = self.e.target(ids, Batch.from_start(len(rows), width, dev, rows=slots), self.cache)
        idx = torch.arange(len(rows), device=dev)
        keys = torch.tensor([r.key for r in rows], device=dev)
        first = self._sample_target(self.e.target.logits(hidden[idx, lens - 1]), keys, lens)
        self.slots.place(slot_ids, rows, lens, first)
        self.admitted = True
        for source in self.sources or ():
            source.after_prefill(slots, hidden, ids, lens, first)
        for r, tok in zip(rows, first.tolist()):
            r.emit([tok], self.params, self.eos, self.e.tokenizer)
        self._sync()
        self.stats.observe_prefill(PrefillRecord(len(rows), len(rows) * width, time.perf_counter() - t0))
        self.slots.release_finished()

    # ---- one speculative step over all active rows -------------------------------------------
    def _step(self) -> None:
        s = self.slots
        n = s.n
        if n == 0:
            return
        if self.refine:      # a refit that is due runs here, untimed: it is no step shape's cost, and
            self.e.cost_model()   # inside the policy's choice it added 12-25 ms to one step's sample
        t_choose = time.perf_counter()
        lengths = s.lengths[:n]                     # unchanged until s.advance below
        ctx = float(lengths.max())                  # every row attends to the longest row's cache
        stands = getattr(self.policy, "plain_stands", None)
        if stands is not None and not self.admitted and stands(n, ctx):   # gamma 0 as last step, its inputs unread
            gamma = 0
        else:
            self.admitted = False         # rows admitted since (a budget ahead of them) are priced here
            per_token_left, fills = self._waiting_fills()
            gamma = min(self.policy.choose(StepContext(rows=n, context_len=ctx, stats=self.stats,
                                                       rows_apart=self._rows_apart(n), waiting_fill_s=per_token_left,
                                                       waiting_fill_total_s=fills)), self.mtp_cap)
        t0 = time.perf_counter()
        keys = s.keys[:n]
        pick = GREEDY_PICK if self.params.greedy else lambda lg, d: self._pick_draft(lg, keys, lengths + d)  # noqa: E731
        if self.coupled is not None and not self.coupled.filtered:
            pick = CoupledDraftPick(pick, self.params.temperature, self.params.seed, keys)
        if self.planner is None:
            plan = StepDrafts(torch.zeros(n, 0, dtype=torch.long, device=lengths.device), None, None, None, 0, None, None)
        else:
            last = self.policy.decisions[-1] if getattr(self.policy, "decisions", None) else None
            measuring = last is not None and (last.measuring or last.calibrating)   # the heads' own steps
            plan = self.planner.plan(n, lengths, s.rows[:n], gamma, pick, self.stats,
                                     getattr(self.policy, "prior", None), ctx, measuring)
        drafts, width = plan.drafts, plan.drafts.shape[1]
        self._sync()
        t1 = time.perf_counter()
        fill_s, filled = self.sources.take_prompt_fill() if self.sources is not None else (0.0, 0)
        if fill_s:                          # prompts' fills deferred from their prefill: prefill work
            self.stats.observe_prefill(PrefillRecord(0, 0, fill_s))
            self.e.costs.note_prompt_fill(fill_s, filled)
        uniform = plan.draft_len is None or width == 0                                # every row drafts `width`
        layout = "padded" if uniform else choose_layout(plan.draft_len, width, self.e.verify_layout)
        if uniform and self.params.greedy:
            hidden, num_acc, emitted = greedy_verify(self.e.target, self.cache, s.last_token[:n], drafts, lengths)
            computed = n * (width + 1)
        elif uniform:
            hidden, logits, positions = uniform_verify(self.e.target, self.cache, s.last_token[:n], drafts, lengths)
            computed = n * (width + 1)
            num_acc, emitted = self._accept(drafts, plan.probs, logits, keys, positions)
        else:
            positions = lengths[:, None] + torch.arange(width + 1, device=lengths.device)  # [n, width + 1]
            hidden, logits, computed = verify_forward(self.e.target, self.cache, s.last_token[:n], drafts,
                                                      plan.draft_len, lengths, layout)
            num_acc, emitted = self._accept(drafts, plan.probs, logits, keys, positions, plan.draft_len, plan.one_hot)
        acc_list, emitted_list = num_acc.tolist(), emitted.tolist()
        t2 = time.perf_counter()
        if self.sources is not None:
            for source in self.sources:
                source.after_verify(n, lengths, hidden, emitted, num_acc, acc_list)
        s.advance(n, num_acc, emitted)
        if uniform:
            emit_uniform(s.rows[:n], self.stats, width, acc_list, emitted_list, self._emit)
        else:
            emit_ragged(s.rows[:n], self.stats, plan, acc_list, emitted_list, self._emit)
        t3 = time.perf_counter()
        s.release_finished()
        t4 = time.perf_counter()
        overhead = (t0 - t_choose) + (t4 - t2)
        heads_fill = self.sources.get("mtp").last_fill_tokens() if plan.mtp_gamma else -1
        step = StepRecord(plan.mtp_gamma if plan.match is None else gamma, n, computed / n, ctx,
                          t2 - t1, t1 - t0 - fill_s, sum(acc_list) + n, overhead, lookup_s=plan.lookup_s,
                          fill_tokens=heads_fill, shared_s=(t0 - t_choose) + (t4 - t3),
                          after_prefill=self.after_prefill)
        if self.after_prefill >= 0:
            self.after_prefill += 1
        self.stats.observe_step(step)
        # the cost model's sample: the heads' depth as they ran (the stats keep the policy's gamma)
        sample = step if step.gamma == plan.mtp_gamma else replace(step, gamma=plan.mtp_gamma)
        self.e.costs.record(sample, refine=self.refine, by_gamma=plan.by_gamma, padded=layout == "padded")

    def _emit(self, row: Row, tokens: list[int]) -> None:
        row.emit(tokens, self.params, self.eos, self.e.tokenizer)
        if row.finished:
            self.lengths.append(len(row.tokens))

    def _waiting_fills(self) -> tuple[float, float]:
        """For the cost-model policy: the heads' waiting fills (prompts of rows that have not
        drafted yet, tokens of gamma-0 steps: a speculative step runs them first), as seconds
        per token their rows are expected to produce still, summed over them, and as seconds in
        all (pipeline.spec_decode.policy). The fill is priced at its whole size
        (CostTracker.prompt_fill_s), each row's share by its tokens. A row's expected
        remainder: `expected_left` over its task's recent rows' output lengths in this engine
        (this call's rows' where the call names no task: calls of different tasks would mix).
        Example: a 114-token prompt at 22 us a token, its task's rows ending at 8 tokens, 1
        generated: 2.5 ms / 7 = 0.36 ms per token left."""
        waiting = self.sources.waiting_tokens() if self.sources is not None and self.refine else {}
        tokens = sum(waiting.values())
        fill_s = self.e.costs.prompt_fill_s(tokens) if tokens else None
        if fill_s is None:
            return 0.0, 0.0
        per_token = fill_s / tokens
        total = whole = 0.0
        ascending = sorted(self.lengths)
        remainders: dict[tuple[int, int], float] = {}     # rows admitted together share (have, left)
        for slot, mine in waiting.items():
            r = self.slots.rows[slot]
            if r is None:
                continue
            key = (len(r.tokens), r.max_new - len(r.tokens))
            rest = remainders.get(key)
            if rest is None:
                rest = remainders[key] = expected_left(ascending, *key)
            total += per_token * mine / rest
            whole += per_token * mine
        return total, whole

    def _rows_apart(self, n: int) -> tuple:
        """For the cost-model policy: the rows it prices on their own (pipeline.spec_decode.policy):
        every row at the tail of a batch that had more than FEW_ROWS slots (queue empty, few rows
        left), else those within gamma_max tokens of their budget. Not every row of a small batch
        (at most FEW_ROWS slots, e.g. batch 1, where the last prompt is a tail all its length): a
        fresh row is a typical one, and a row priced down to gamma 0 after two misses would draft
        no more and never be priced up (docs/decisions.md, 2026-12-02)."""
        if not self.refine or not self.mtp_cap:
            return ()
        cap, few = self.mtp_cap, n <= FEW_ROWS and not self.queue and len(self.slots.rows) > FEW_ROWS
        apart = []
        for r in self.slots.rows[:n]:
            if r is None:
                continue
            left = r.max_new - len(r.tokens)          # more than gamma_max left never binds: one value
            if few or left <= cap:                    # for all of those keeps the decision reusable
                apart.append((min(left, cap + 1), r.drafted_steps, r.first_hits))
        return tuple(sorted(apart))

    # ---- sampling ------------------------------------------------------------------------------
    # Coupled (pipeline/engine/coupled.py): the target and the drafts pick with the same keyed
    # noise per position, a draft is kept when it equals the target's token. Rejection: the
    # min(1, p/q) rule with one uniform per decision. Greedy: argmax (native.argmax).
    def _pick_draft(self, logits, keys, positions):
        p = self.params
        if p.greedy:
            return native.argmax(logits), None
        probs = filtered_probs(logits, p.temperature, p.top_k, p.top_p)                  # [n, V]
        if self.coupled:
            return self.coupled.draft(probs, keys, positions), None
        return sample(probs, rng.uniforms(p.seed, keys, positions, rng.DRAFT)), probs

    def _sample_target(self, logits, keys, positions):
        """logits [n, V] or [n, q, V]; positions [n] or [n, q]: where the sampled tokens land."""
        p = self.params
        if p.greedy:
            return native.argmax(logits)
        probs = filtered_probs(logits, p.temperature, p.top_k, p.top_p)
        if self.coupled:
            return self.coupled.target(probs, keys, positions)
        return sample(probs, rng.uniforms(p.seed, keys, positions, rng.TARGET))

    def _accept(self, drafts, draft_probs, logits, keys, positions, draft_len=None, one_hot=None):
        """positions: [n, gamma + 1] of the verify inputs; token j lands at positions + 1.
        draft_len: [n] drafts per row (padded slots are PAD and never match), else all gamma;
        one_hot: [n] rows whose drafts are deterministic (q one-hot: acceptance.rejection_sample_ragged)."""
        p = self.params
        if p.greedy:
            return greedy_accept(drafts, logits, native.argmax)
        out_pos = positions + 1
        if self.coupled:
            return coupled_accept(drafts, self._sample_target(logits, keys, out_pos))
        probs = filtered_probs(logits, p.temperature, p.top_k, p.top_p)
        u_final = rng.uniforms(p.seed, keys, out_pos, rng.TARGET)
        if drafts.shape[1] == 0:
            return torch.zeros_like(keys), sample(probs, u_final)
        u_accept = rng.uniforms(p.seed, keys, out_pos[:, :-1], rng.ACCEPT)
        if draft_len is not None:
            return rejection_sample_ragged(drafts, draft_probs, probs, u_accept, u_final, draft_len, one_hot)
        return rejection_sample(drafts, draft_probs, probs, u_accept, u_final)

    def _sync(self) -> None:
        if self.e.device.type == "cuda":
            torch.cuda.synchronize(self.e.device)
