"""The engine: a target model with its draft sources, usable without Ray.

`Engine.generate` tokenises the prompts, resolves gamma and the draft sources, and runs one
`GenerateRun` (pipeline.engine.run: the batched decoding loop) over the rows; the engine keeps
what outlives a call (KV caches, the cost tracker, acceptance stats, the n-gram task indexes).
"""
from __future__ import annotations


import contextlib
from collections import deque

import torch

from pipeline.engine.costs import CostTracker
from pipeline.engine.drafters import Sources, TaskIndex, make_sources, resolve_draft
from pipeline.engine.params import DEFAULT_GAMMA_MAX, RequestOutput, SamplingParams
from pipeline.engine.warm_start import checkpoint_mixture, checkpoint_prior, ensure_profile
from pipeline.engine.rows import Row
from pipeline.engine.run import GenerateRun
from pipeline.model import native
from pipeline.model.cache import KVCache
from pipeline.model.draft_window import read_draft_window
from pipeline.model.loader import load_model, resolve_device, resolve_dtype
from pipeline.spec_decode.cost import CostModel
from pipeline.spec_decode.policy import FixedGamma, GammaPolicy, GoodputPolicy, make_policy
from pipeline.spec_decode.prior_mix import PriorMixture
from pipeline.spec_decode.stats import SpecStats


CACHE_STEP = 64         # a new KV cache's positions are rounded up to a multiple of this (Engine.kv_cache)
_KEEP_STEPS = 4096      # step records an engine keeps for the cost model and stats export


def _round_positions(t: int, context: int) -> int:
    """t rounded up to a multiple of CACHE_STEP, not past the model's context (no row needs
    positions past it and its drafts). Example, context 1024: 443 -> 448, 1030 -> 1030."""
    return max(t, min(-(-t // CACHE_STEP) * CACHE_STEP, context))


def _compute_threads(device: torch.device):
    """On CPU, torch's threads run the C kernels and torch's own ops one
    (pipeline.model.native.cpu_threads); elsewhere nothing changes."""
    return native.cpu_threads() if device.type == "cpu" else contextlib.nullcontext()


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
        self._task_priors: dict[str, SpecStats | None] = {}   # task -> its held-out acceptance, read once
        self._mixture = checkpoint_mixture(getattr(loaded, "path", None))    # its tasks, for calls naming none
        self.task_indexes: dict[str | None, TaskIndex] = {}   # task -> its recent outputs (n-gram drafting)
        self.ngram_evidence: dict[str | None, SpecStats] = {}  # task -> n-gram acceptance by match and depth
        self.output_lengths: dict[str, deque] = {}            # task -> its recent finished rows' lengths
        self.verify_layout = "auto"           # "padded" | "packed" | "auto" (pipeline.engine.verify)
        path = getattr(loaded, "path", None)  # the MTP heads read each prompt's last this many tokens (0: all)
        self.draft_window = read_draft_window(path) if path is not None else 0   # (pipeline.model.draft_window)

    @classmethod
    def from_pretrained(cls, path, device: str = "auto", dtype="auto", max_batch_size: int = 32,
                        gamma_max: int = DEFAULT_GAMMA_MAX, allow_pickle: bool = False) -> "Engine":
        """allow_pickle: load *.bin/*.pt weights when there are no safetensors (off: refused)."""
        dev = resolve_device(device)
        with _compute_threads(dev):               # the kernels' crossovers timed as they will run
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

    @property
    def draft_names(self) -> tuple[str, ...]:
        """The draft sources this checkpoint has: ("mtp", "ngram"), or ("ngram",) without heads."""
        return resolve_draft("auto", bool(self.heads))

    def draft_sources(self, rows: int, capacity: int, names=None, task_index: TaskIndex | None = None,
                      coupled: bool = False, held_cache: bool = False) -> Sources | None:
        """This checkpoint's draft sources (or those of `names` it has) for `rows` slots of
        `capacity` tokens: what a generate call drafts with, and what profiles and benchmarks
        time through each source's `probe` and `cost_per` (pipeline.engine.drafters.base)."""
        return make_sources(self, self.draft_names if names is None else names, rows, capacity, task_index,
                            coupled, held_cache)

    def reset_stats(self) -> None:
        self.stats = SpecStats()

    def kv_cache(self, kind: str, num_layers: int, batch: int, capacity: int, num_kv_heads: int,
                 head_dim: int) -> KVCache:
        """A KV cache of at least this size for a generate call: the last call's where it fits,
        else a new one (the old one released first, so two are never held). Reuse skips zeroing
        tens of MB per call; what a slot held before is masked and overwritten like any rolled-back draft
        (pipeline.model.cache). A new one's positions are rounded up to CACHE_STEP (not past the
        model's context), and it covers the old one's rows and positions too where that at most
        doubles it: calls whose needs differ by a few drafts (the heads' gamma 5 against 10 with
        n-gram tails) or prompt tokens then share one, while 256 short rows followed by one long
        prompt do not make a 256-row cache of the long one's length. At 48 rows the demo's cache
        is ~180 MB (~250 ms to allocate), the heads' ~10 ms."""
        held = self._caches.get(kind)
        if held is not None and held.fits(num_layers, batch, capacity, num_kv_heads, head_dim):
            return held
        capacity = _round_positions(capacity, self.config.max_position_embeddings)
        if held is not None and held.fits(num_layers, 1, 1, num_kv_heads, head_dim):
            rows, positions = max(batch, held.k.shape[1]), max(capacity, held.capacity)
            if rows * positions <= 2 * batch * capacity:        # the old one's size too, where at most twice
                batch, capacity = rows, positions
        held = self._caches.pop(kind, None)
        del held                                    # freed before the new one is allocated
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
            with self.threads():
                ensure_profile(self, context_len, rows, explore)

    def threads(self):
        """The context the engine computes in (`_compute_threads`)."""
        return _compute_threads(self.device)

    def note_utilization(self, utilization: float | None) -> None:
        """Utilisation measured over a shard; a large change marks the cost profile stale."""
        self.costs.note_utilization(utilization)

    def checkpoint_prior(self, task: str | None = None) -> SpecStats | None:
        """The checkpoint's held-out acceptance for `task` (pipeline.engine.warm_start), all
        tasks pooled where the file does not hold it or no task is named. `spec_prior` None
        (no file, or a caller turned the shipped prior off) means none for any task."""
        if task is None or self.spec_prior is None:
            return self.spec_prior
        if task not in self._task_priors:
            self._task_priors[task] = checkpoint_prior(getattr(self.model, "path", None), task)
        return self._task_priors[task]

    def checkpoint_mixture(self, task: str | None = None) -> PriorMixture | None:
        """Where `task` is not one the checkpoint's prior holds (or None): its tasks as a mixture
        that the call's own drafts weigh (pipeline.spec_decode.prior_mix); None where the task
        is held, the prior is off (`spec_prior` None), or the file holds fewer than two tasks."""
        mix = self._mixture
        if self.spec_prior is None or mix is None or (task is not None and task in mix.names):
            return None
        return mix

    def auto_policy(self, prior: SpecStats | None = None, context_len: int = 128, planned: int | None = None,
                    calibrate: bool = True, rows: int | None = None, explore: bool = False,
                    task: str | None = None) -> GoodputPolicy:
        """A GoodputPolicy over this engine's cost model. `prior`: acceptance measured on earlier
        shards of the same task; where it is short, the checkpoint's spec_prior.json (else the
        policy calibrates at gamma_max first). `planned`, `calibrate`: the driver's plan.
        `rows`: the call's rows (the profile covers batch sizes up to them). `explore`: a
        one-off call (generate's own "auto") that may skip the profile (warm_start.explores);
        a run's actors profile, since their profile serves every shard and the driver's plans.
        `task`: the checkpoint's prior of that task rather than all tasks pooled."""
        self.ensure_profile(context_len, rows, explore)
        policy = GoodputPolicy(self.gamma_max, self.cost_model, prior or SpecStats(), planned=planned,
                               calibrate=calibrate)
        shipped = self.checkpoint_prior(task)
        if shipped is not None and (policy.prior.reached or [0])[0] < policy.calibration_rows:
            policy.mixture = self.checkpoint_mixture(task)      # a task the file does not name: its tasks, weighed
            if policy.mixture is None:
                policy.prior = policy.prior.merge(shipped)
            policy.calibrated = True      # held-out acceptance at every depth: a calibration, however light
        policy.plain_first = bool(self.costs.profile)       # without a profile, plain decoding's price is the call's own
        return policy

    # ---- public entry ------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams | None = None, gamma="auto",
                 row_keys=None, draft: str = "auto", task: str | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. `gamma`: an int >= 0, "auto", or a GammaPolicy.
        `row_keys`: optional int per prompt keying its random stream (default: its position),
        so a row samples the same tokens whichever batch, shard or retry it runs in.
        `draft`: "auto" (per row, the source that pays), "mtp", "ngram" or "none". `task`: the
        rows' task: n-gram drafting searches that task's recent outputs (kept across calls), and the
        heads' gamma policy starts from the checkpoint's acceptance of that task (spec_prior.json)."""
        params = params or SamplingParams()
        if row_keys is not None and len(row_keys) != len(prompts):
            raise ValueError(f"row_keys has {len(row_keys)} entries for {len(prompts)} prompts")
        sources = resolve_draft(draft, bool(self.heads))
        if draft == "auto" and not (gamma == "auto" or hasattr(gamma, "choose")) and self.heads:
            sources = ("mtp",)            # an int gamma with heads means what it always meant: the heads
        policy = self._resolve_policy(gamma, len(prompts), sources, task)
        self.last_policy = policy
        rows = [self._make_row(i, p, params) for i, p in enumerate(prompts)]
        for row, key in zip(rows, row_keys or ()):
            row.key = int(key)
        live = [r for r in rows if r.out.error is None]
        self.last_stats = SpecStats()
        if live:
            with self.threads():
                GenerateRun(self, live, params, policy, sources, gamma, task).run()
        self.stats = self.stats.merge(self.last_stats)
        del self.stats.steps[:-_KEEP_STEPS], self.stats.prefills[:-_KEEP_STEPS]   # bounded memory
        return [r.finalize(params, self.tokenizer) if r.out.error is None else r.out for r in rows]

    def _resolve_policy(self, gamma, rows: int | None = None, sources: tuple = ("mtp", "ngram"),
                        task: str | None = None) -> GammaPolicy:
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
            return self.auto_policy(prior=self.stats, rows=rows, explore=True, task=task)
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
