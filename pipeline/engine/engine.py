"""The batched speculative decoder with continuous batching, usable without Ray.

One iteration (`_step`): admit queued rows into free slots (batched prefills of prompts of
similar length, `prefill_groups`), choose gamma, draft (each row from its own source, with its
own number of drafts: pipeline.engine.drafting), verify last token + drafts in one target
forward for every active row, accept per row, emit. Each row advances by its own acceptance
length; rejected drafts are rolled back by not advancing its length.
"""
from __future__ import annotations

import time
from collections import deque

import torch

from pipeline.engine.coupled import CoupledSampler
from pipeline.engine.costs import CostTracker
from pipeline.engine.drafter import Drafter
from pipeline.engine.drafters import MTPSource, NgramSource, Sources, TaskIndex, resolve_draft
from pipeline.engine.drafting import DraftPlanner, StepDrafts
from pipeline.engine.emit import emit_ragged, emit_uniform
from pipeline.engine.verify import verify_forward
from pipeline.engine.params import DEFAULT_GAMMA_MAX, RequestOutput, SamplingParams
from pipeline.engine.warm_start import checkpoint_prior, ensure_profile
from pipeline.engine.rows import Row
from pipeline.engine.slots import Slots
from pipeline.model.cache import Batch, KVCache
from pipeline.model.loader import load_model, resolve_device, resolve_dtype
from pipeline.spec_decode import rng
from pipeline.spec_decode.acceptance import coupled_accept, greedy_accept, rejection_sample, rejection_sample_ragged
from pipeline.spec_decode.cost import CostModel
from pipeline.spec_decode.policy import FEW_ROWS, FixedGamma, GammaPolicy, GoodputPolicy, StepContext, make_policy
from pipeline.spec_decode.sampling import filtered_probs, sample
from pipeline.spec_decode.stats import PrefillRecord, SpecStats, StepRecord


TASK_INDEX_TOKENS = 32768   # output tokens an engine keeps per task for n-gram drafting
_KEEP_STEPS = 4096      # step records an engine keeps for the cost model and stats export
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


class Engine:
    def __init__(self, loaded, tokenizer=None, max_batch_size: int = 32,
                 gamma_max: int = DEFAULT_GAMMA_MAX):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if gamma_max < 0:
            raise ValueError(f"gamma_max must be >= 0, got {gamma_max}")
        self.model = loaded
        self.target, self.heads, self.config = loaded.target, loaded.heads, loaded.config
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.gamma_max = gamma_max
        self.device = self.target.model.norm.weight.device
        self.dtype = self.target.model.norm.weight.dtype
        self.stats = SpecStats()              # everything this engine measured, all calls
        self.last_stats = SpecStats()         # the last generate call alone
        self.costs = CostTracker()            # profile, measured steps, fitted cost model
        self.last_policy: GammaPolicy | None = None   # its .decisions explain each step's gamma
        self._caches: dict[str, KVCache] = {}          # the last call's KV caches, reused where they fit
        self.spec_prior: SpecStats | None = checkpoint_prior(getattr(loaded, "path", None))   # all tasks pooled
        self.task_indexes: dict[str | None, TaskIndex] = {}   # task -> its recent outputs (n-gram drafting)
        self.ngram_evidence: dict[str | None, SpecStats] = {}  # task -> n-gram acceptance by match and depth
        self.verify_layout = "auto"           # "padded" | "packed" | "auto" (pipeline.engine.verify)

    @classmethod
    def from_pretrained(cls, path, device: str = "auto", dtype="auto", max_batch_size: int = 32,
                        gamma_max: int = DEFAULT_GAMMA_MAX, allow_pickle: bool = False) -> "Engine":
        """allow_pickle: load *.bin/*.pt weights when there are no safetensors (off: refused)."""
        dev = resolve_device(device)
        loaded = load_model(path, device=dev, dtype=resolve_dtype(dtype, dev), fuse=True,
                            allow_pickle=allow_pickle)
        tokenizer = None
        try:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        except (OSError, ValueError):
            tokenizer = None          # token-id prompts still work; string prompts get an error row
        return cls(loaded, tokenizer, max_batch_size=max_batch_size, gamma_max=gamma_max)

    @property
    def num_mtp_heads(self) -> int:
        return len(self.heads)

    def reset_stats(self) -> None:
        self.stats = SpecStats()

    def kv_cache(self, kind: str, num_layers: int, batch: int, capacity: int, num_kv_heads: int,
                 head_dim: int) -> KVCache:
        """A KV cache of at least this size for a generate call: the last call's where it fits,
        else a new one (the old one released first, so two are never held). Reuse skips zeroing
        tens of MB per call; what a slot held before is masked and overwritten like any rolled-back draft
        (pipeline.model.cache)."""
        held = self._caches.get(kind)
        if held is not None and held.fits(num_layers, batch, capacity, num_kv_heads, head_dim):
            return held
        self._caches.pop(kind, None)
        self._caches[kind] = KVCache(num_layers, batch, capacity, num_kv_heads, head_dim, self.dtype, self.device)
        return self._caches[kind]

    # ---- the measured gamma policy -------------------------------------------------------------
    def cost_model(self) -> CostModel | None:
        """The cost model fitted from the profile and every measured step (this call's too)."""
        return self.costs.model()

    def ensure_profile(self, context_len: int = 128, rows: int | None = None, explore: bool = False) -> None:
        """Profile the accelerator at batch sizes up to `rows` (default max_batch_size), each
        once, from the on-disk cache where it has them, and again whenever the tracker finds
        the profile stale (pipeline.engine.warm_start). `explore`: a small call may measure on
        its own steps instead."""
        if self.heads:
            ensure_profile(self, context_len, rows, explore)

    def note_utilization(self, utilization: float | None) -> None:
        """Utilisation measured over a shard; a large change marks the cost profile stale."""
        self.costs.note_utilization(utilization)

    def auto_policy(self, prior: SpecStats | None = None, context_len: int = 128, planned: int | None = None,
                    calibrate: bool = True, rows: int | None = None, explore: bool = False) -> GoodputPolicy:
        """A GoodputPolicy over this engine's cost model. `prior`: acceptance measured on earlier
        shards of the same task; where it is short, the checkpoint's spec_prior.json (else the
        policy calibrates at gamma_max first). `planned`, `calibrate`: the driver's plan.
        `rows`: the call's rows (the profile covers batch sizes up to them). `explore`: a
        one-off call (generate's own "auto") that may skip the profile (warm_start.explores);
        a run's actors profile, since their profile serves every shard and the driver's plans."""
        self.ensure_profile(context_len, rows, explore)
        policy = GoodputPolicy(self.gamma_max, self.cost_model, prior or SpecStats(), planned=planned,
                               calibrate=calibrate)
        if self.spec_prior is not None and (policy.prior.reached or [0])[0] < policy.calibration_rows:
            policy.prior = policy.prior.merge(self.spec_prior)
        return policy

    # ---- public entry ------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams | None = None, gamma="auto",
                 row_keys=None, draft: str = "auto", task: str | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. `gamma`: an int >= 0, "auto", or a GammaPolicy.
        `row_keys`: optional int per prompt keying its random stream (default: its position),
        so a row samples the same tokens whichever batch, shard or retry it runs in.
        `draft`: "auto" (per row, the source that pays), "mtp", "ngram" or "none". `task`: the
        rows' task: n-gram drafting searches that task's recent outputs (kept across calls)."""
        params = params or SamplingParams()
        if row_keys is not None and len(row_keys) != len(prompts):
            raise ValueError(f"row_keys has {len(row_keys)} entries for {len(prompts)} prompts")
        sources = resolve_draft(draft, bool(self.heads))
        if draft == "auto" and not (gamma == "auto" or hasattr(gamma, "choose")) and self.heads:
            sources = ("mtp",)            # an int gamma with heads means what it always meant: the heads
        policy = self._resolve_policy(gamma, len(prompts), sources)
        self.last_policy = policy
        rows = [self._make_row(i, p, params) for i, p in enumerate(prompts)]
        for row, key in zip(rows, row_keys or ()):
            row.key = int(key)
        live = [r for r in rows if r.out.error is None]
        self.last_stats = SpecStats()
        if live:
            _Run(self, live, params, policy, sources, gamma, task).run()
        self.stats = self.stats.merge(self.last_stats)
        del self.stats.steps[:-_KEEP_STEPS], self.stats.prefills[:-_KEEP_STEPS]   # bounded memory
        return [r.finalize(params, self.tokenizer) if r.out.error is None else r.out for r in rows]

    def _resolve_policy(self, gamma, rows: int | None = None, sources: tuple = ("mtp", "ngram")) -> GammaPolicy:
        """The MTP gamma policy (FixedGamma(0) where the heads do not draft)."""
        if isinstance(gamma, bool) or not (gamma == "auto" or isinstance(gamma, int) or hasattr(gamma, "choose")):
            raise ValueError(f"gamma must be an int >= 0, 'auto' or a policy, got {gamma!r}")
        if isinstance(gamma, int):
            if gamma < 0:
                raise ValueError(f"gamma must be >= 0, got {gamma}")
            if gamma > 0 and not self.heads and "ngram" not in sources:
                raise ValueError(f"gamma={gamma} needs MTP heads; {self.model.path} has none (use gamma=0)")
        if "mtp" not in sources:
            return FixedGamma(0, "the MTP heads do not draft in this call")
        if gamma == "auto" and self.heads and self.gamma_max > 0:
            return self.auto_policy(prior=self.stats, rows=rows, explore=True)
        return make_policy(gamma)

    def _make_row(self, index: int, prompt, params: SamplingParams) -> Row:
        out = RequestOutput()
        row = Row(index, [], 0, out)
        try:
            ids = self._tokenize(prompt)
        except (TypeError, ValueError) as exc:
            out.error = str(exc)
            return row
        limit = self.config.max_position_embeddings
        if len(ids) >= limit:
            if not params.truncate_prompt:
                out.error = f"prompt has {len(ids)} tokens; the model's context is {limit}"
                return row
            ids = ids[-max(1, limit - params.max_new_tokens):]
        row.prompt_ids = ids
        row.max_new = min(params.max_new_tokens, limit - len(ids))
        out.num_prompt_tokens = len(ids)
        return row

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            if self.tokenizer is None:
                raise ValueError("string prompt but the checkpoint has no tokenizer; pass token ids")
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)) or (isinstance(prompt, torch.Tensor) and prompt.dim() == 1):
            ids = [int(t) for t in prompt]
        else:
            raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.config.vocab_size}): {bad[:5]}")
        return ids


class _Run:
    """State of one generate() call: slots, caches, queue, draft sources."""

    def __init__(self, engine: Engine, rows: list[Row], params: SamplingParams, policy: GammaPolicy,
                 sources: tuple = ("mtp",), gamma=None, task: str | None = None):
        """`sources`: the draft sources (resolve_draft); `gamma`: the caller's gamma (default: the
        policy); defaults draft with the heads under `policy` alone."""
        self.e, self.params, self.policy = engine, params, policy
        gamma = policy if gamma is None else gamma
        cfg = engine.config
        self.auto = gamma == "auto" or isinstance(gamma, GoodputPolicy)
        self.mtp_cap = min(engine.gamma_max, policy.max_gamma()) if engine.heads and "mtp" in sources else 0
        ngram_cap = 0
        if "ngram" in sources:
            ngram_cap = engine.gamma_max if gamma == "auto" else gamma.max_gamma() if hasattr(gamma, "choose") else int(gamma)
        self.gamma_cap = max(self.mtp_cap, ngram_cap)
        batch = min(engine.max_batch_size, len(rows))
        capacity = max(len(r.prompt_ids) + r.max_new for r in rows) + self.gamma_cap + 2
        self.cache = engine.kv_cache("target", cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim)
        self.drafter = None
        found = {}
        if self.mtp_cap > 0:
            attn = engine.heads[0].self_attn
            heads_cache = engine.kv_cache("heads", len(engine.heads), batch, capacity, attn.num_kv_heads, attn.head_dim)
            self.drafter = Drafter(engine.heads, batch, capacity, cfg.hidden_size, engine.dtype, engine.device,
                                   cache=heads_cache)
            self.drafter.full_vocab_picks = params.coupled
            found["mtp"] = MTPSource(self.drafter)
        if ngram_cap > 0:
            index = engine.task_indexes.setdefault(task, TaskIndex(TASK_INDEX_TOKENS))
            found["ngram"] = NgramSource(index, engine.device)
            if self.auto:
                ensure_profile(engine, rows=batch, explore=self.mtp_cap > 0)   # per-row choice prices drafts by the cost model
        self.sources = Sources(found) if found else None
        self.planner = None
        if found:
            evidence = engine.ngram_evidence.get(task)
            self.planner = DraftPlanner(self.sources, self.auto, ngram_cap, evidence, engine.cost_model, params,
                                        engine.verify_layout)
        self.task = task
        self.slots = Slots(batch, engine.device, self.sources, self.cache)
        self.queue = deque(rows)
        self.eos = frozenset(cfg.eos_token_ids)
        self.stats = engine.last_stats
        self.refine = isinstance(policy, GoodputPolicy)     # its steps count towards cost-model refits
        self.coupled = (CoupledSampler(params.seed, filtered=params.top_k > 0 or params.top_p < 1)
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
        while self.queue and (free := self.slots.free_slots()):
            take = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
            for group in prefill_groups([len(r.prompt_ids) for r in take]):
                self._prefill([free[i] for i in group], [take[i] for i in group])
        self.slots.compact()                           # rows may finish at once: the loop refills

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
        t_choose = time.perf_counter()
        lengths = s.lengths[:n]                     # unchanged until s.advance below
        ctx = float(lengths.float().mean())
        gamma = min(self.policy.choose(StepContext(rows=n, context_len=ctx, stats=self.stats,
                                                   rows_apart=self._rows_apart(n))), self.mtp_cap)
        t0 = time.perf_counter()
        keys = s.keys[:n]
        pick = lambda lg, d: self._pick_draft(lg, keys, lengths + d)    # noqa: E731
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
        if plan.draft_len is None or width == 0:
            tokens = torch.cat([s.last_token[:n, None], drafts], dim=1)                # [n, gamma + 1]
            positions = lengths[:, None] + torch.arange(width + 1, device=lengths.device)
            hidden = self.e.target(tokens, Batch.make(positions), self.cache)         # [n, gamma + 1, H]
            logits = self.e.target.logits(hidden)                                     # [n, gamma + 1, V]
            computed = n * (width + 1)
            num_acc, emitted = self._accept(drafts, plan.probs, logits, keys, positions)
        else:
            hidden, logits, computed = verify_forward(self.e.target, self.cache, s.last_token[:n], drafts,
                                                      plan.draft_len, lengths, self.e.verify_layout)
            positions = lengths[:, None] + torch.arange(width + 1, device=lengths.device)
            num_acc, emitted = self._accept(drafts, plan.probs, logits, keys, positions, plan.draft_len, plan.one_hot)
        acc_list, emitted_list = num_acc.tolist(), emitted.tolist()
        t2 = time.perf_counter()
        if s.drafter is not None:
            for source in s.drafter:
                source.after_verify(n, lengths, hidden, emitted, num_acc)
        s.advance(n, num_acc, emitted)
        if plan.draft_len is None or width == 0:
            self._emit_uniform(n, width, acc_list, emitted_list)
        else:
            self._emit_ragged(n, plan, acc_list, emitted_list)
        s.release_finished()
        overhead = (t0 - t_choose) + (time.perf_counter() - t2)
        step = StepRecord(plan.mtp_gamma if plan.match is None else gamma, n, computed / n, ctx,
                          t2 - t1, t1 - t0, sum(acc_list) + n, overhead)
        self.stats.observe_step(step)
        if plan.match is None or not any(plan.match):   # n-gram rows make a step no gamma prices
            self.e.costs.record(step, refine=self.refine)

    def _emit_uniform(self, n: int, gamma: int, acc_list: list[int], emitted_list: list[list[int]]) -> None:
        emit_uniform(self.slots.rows[:n], self.stats, gamma, acc_list, emitted_list, self._emit)

    def _emit_ragged(self, n: int, plan: StepDrafts, acc_list: list[int], emitted_list: list[list[int]]) -> None:
        emit_ragged(self.slots.rows[:n], self.stats, plan, acc_list, emitted_list, self._emit)

    def _emit(self, row: Row, tokens: list[int]) -> None:
        row.emit(tokens, self.params, self.eos, self.e.tokenizer)

    def _rows_apart(self, n: int) -> tuple:
        """For the cost-model policy: the rows it prices on their own (pipeline.spec_decode.policy):
        every row at a tail (queue empty, few rows left), else those within gamma_max tokens of
        their budget. Not every row of a small batch: a fresh row is a typical one, and a row
        priced down to gamma 0 after two misses would draft no more and never be priced up."""
        if not self.refine or not self.mtp_cap:
            return ()
        cap, few = self.mtp_cap, n <= FEW_ROWS and not self.queue
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
    # min(1, p/q) rule with one uniform per decision. Greedy: argmax.
    def _pick_draft(self, logits, keys, positions):
        p = self.params
        if p.greedy:
            return logits.argmax(-1), None
        probs = filtered_probs(logits, p.temperature, p.top_k, p.top_p)                  # [n, V]
        if self.coupled:
            return self.coupled.draft(probs, keys, positions), None
        return sample(probs, rng.uniforms(p.seed, keys, positions, rng.DRAFT)), probs

    def _sample_target(self, logits, keys, positions):
        """logits [n, V] or [n, q, V]; positions [n] or [n, q]: where the sampled tokens land."""
        p = self.params
        if p.greedy:
            return logits.argmax(-1)
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
            return greedy_accept(drafts, logits)
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
