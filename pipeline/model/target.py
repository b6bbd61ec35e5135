"""The target model: a native forward for Llama-family checkpoints over a per-row KV cache."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pipeline.model import native
from pipeline.model.cache import Batch, KVCache
from pipeline.model.config import ArchConfig
from pipeline.model.layers import DecoderLayer, RMSNorm, fold_sin, native_step, native_tokens
from pipeline.model.packed import cpu_linear, pack_linears_


PREFILL_TOKENS = 512      # a prefill's tokens per C call of the layers (rows of one admission group) ...
PREFILL_PIECE = 128       # ... of at most this many positions a row
PREFILL_MAX = 768         # prompts up to this many tokens: past it torch's attention (SDPA) gains on the C one


class _Body(nn.Module):
    """Holds the parameters stored under `model.*` in Hugging Face checkpoints."""

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, w) for w in cfg.sliding_windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TargetModel(nn.Module):
    def __init__(self, cfg: ArchConfig, hf_config):
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._hf_config = hf_config
        self.rotary: nn.Module | None = None
        self.tied_head: nn.Module | None = None     # tied output head, packed (pack_)
        self._rope_cos: torch.Tensor | None = None  # [length, head_dim] rotary tables by position
        self._rope_sin: torch.Tensor | None = None
        self.rope_table = True                      # False: rotary per forward (benchmark baseline)
        self._native_stack = (None, None)           # ((layers' generation, count), their stack): `native_stack`
        self.fused_step = True                      # False: a step's embedding, stack and norm as separate calls

    def pack_(self) -> None:
        """Inference on CPU: linears stored [in, out], the tied output head too (a transposed copy
        of the embedding; pipeline.model.packed)."""
        pack_linears_(self)
        if self.lm_head is None:
            self.tied_head = cpu_linear(self.model.embed_tokens.weight)

    def init_rotary(self, device) -> None:
        """Rotary frequencies come from transformers' own code, so every RoPE variant matches."""
        self.rotary = LlamaRotaryEmbedding(self._hf_config).to(device)
        self._rope_cos = self._rope_sin = None

    def attach_rope(self, batch: Batch) -> Batch:
        """Rotary tables for `batch.positions`: rows of a table computed once per length by
        transformers' own rotary (one gather per forward instead of a dozen small ops; the same
        values, each entry being one product and its cos/sin). RoPE types whose frequencies
        change with the sequence length (dynamic, longrope), and training, compute them per forward."""
        if batch.cos is None:
            tables = None if torch.is_grad_enabled() else self.rope_tables(batch.kv_len)  # training: no cached tensors
            if tables is None:
                batch.cos, sin = self.rotary(self.model.norm.weight, batch.positions)     # [n, q, head_dim]
                batch.sin = fold_sin(sin)
                return batch
            batch.cos, batch.sin = tables[0][batch.positions], tables[1][batch.positions]
        return batch

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin folded) [>= length, head_dim] by position (grown as needed), or None where
        RoPE's frequencies depend on the sequence (dynamic, longrope) or tables are off."""
        per_forward = "dynamic" in self.rotary.rope_type or self.rotary.rope_type == "longrope"
        if per_forward or not self.rope_table:
            return None
        if self._rope_cos is None or self._rope_cos.shape[0] < length:
            held = 0 if self._rope_cos is None else self._rope_cos.shape[0]
            dummy = self.model.norm.weight
            cos, sin = self.rotary(dummy, torch.arange(max(length, 2 * held, 256), device=dummy.device)[None])
            self._rope_cos, self._rope_sin = cos[0], fold_sin(sin[0])           # [length, head_dim]
        return self._rope_cos, self._rope_sin

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(tokens)

    def forward(self, tokens: torch.Tensor, batch: Batch, cache: KVCache | None) -> torch.Tensor:
        """tokens: [n, q] at `batch.positions`. Returns final-norm'ed hidden states [n, q, hidden]."""
        stack = self.native_stack()
        if cache is None or not cache.k.is_contiguous():
            stack = None                                # the C stack reads the whole cache's layout
        fused = self._fused_step(tokens, batch, cache, stack)
        if fused is not None:
            return fused
        self.attach_rope(batch)
        x = self.embed(tokens)
        if stack is not None and native_step(x, batch, cache, stack.max_tokens):
            x = native.decoder_stack(stack, x, batch.positions, None if batch.prefix else batch.rows, batch.cos,
                                     batch.sin, cache.k, cache.v, batch.key_valid)
        elif stack is not None and self._native_prefill(x, batch, cache, stack):
            x = self._prefill_pieces(stack, x, batch, cache)
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer.block(x, batch, cache, i)
        return self.model.norm.forward(x)

    def _fused_step(self, tokens: torch.Tensor, batch: Batch, cache: KVCache | None,
                    stack: native.NativeStack | None) -> torch.Tensor | None:
        """A cached step's whole forward as one C call (native.target_forward: the embedding and
        rotary rows, the stack, the final norm where it takes the C kernel), or None where the
        step is not one the C stack takes as it stands (`native_step`, asked of a view shaped as
        the embedding would be), or its parts are not plain float32 tables. Its values are the
        module path's; it saves ~10 small torch calls a step, each slow after the stack has
        streamed the weights through the caches."""
        if (not self.fused_step or stack is None or batch.cos is not None or tokens.dtype != torch.long
                or not hasattr(stack.lib, "target_forward")):
            return None
        table = self.model.embed_tokens.weight
        if (table.dtype != torch.float32 or not table.is_contiguous()
                or (torch.is_grad_enabled() and table.requires_grad)):   # (a view of it would claim its gradient)
            return None
        x = table.detach()[None, :1].expand(*tokens.shape, -1)  # shaped as the embedding would be
        if not native_step(x, batch, cache, stack.max_tokens):
            return None
        tables = self.rope_tables(batch.kv_len)
        if tables is None:
            return None
        norm = self.model.norm
        c_norm = norm.takes_native(x)
        y = native.target_forward(stack, tokens, table, tables[0], tables[1], (norm.weight, norm.eps) if c_norm else None,
                                  batch.positions, None if batch.prefix else batch.rows, cache.k, cache.v,
                                  batch.key_valid)
        return y if c_norm else norm.forward(y)

    @staticmethod
    def _native_prefill(x: torch.Tensor, batch: Batch, cache: KVCache | None, stack: native.NativeStack) -> bool:
        """A prefill from position 0 that the C stack takes in pieces (`_prefill_pieces`): float32,
        cached, no gradient, at most PREFILL_MAX positions (at 750 a prompt it took 0.99x torch's time)."""
        return (batch.from_zero and batch.key_valid is None and x.shape[1] <= PREFILL_MAX
                and native_tokens(x[:1, :1], cache, stack.max_tokens))

    @staticmethod
    def _prefill_pieces(stack: native.NativeStack, x: torch.Tensor, batch: Batch, cache: KVCache) -> torch.Tensor:
        """The layers over a prefill as C calls of PREFILL_PIECE positions of as many rows as fit
        PREFILL_TOKENS tokens, each row's pieces in order: a piece attends to the keys its
        earlier pieces cached, as a verify step does, and its queries' scores stay in L2 (a
        484-token prompt in one call was slower than torch's modules). Attention skips the keys
        past each query, and the small ops (norms, RoPE, cache writes, SiLU) are no torch calls:
        a 32-row prefill of the demo's prompts took 0.82-0.89x torch's modules' time at 18-460
        tokens a prompt (docs/decisions.md, stop 53)."""
        n, q = x.shape[:2]
        piece = min(q, PREFILL_PIECE)
        per = max(PREFILL_TOKENS // piece, 1)
        out = torch.empty_like(x)
        for r in range(0, n, per):
            e = min(r + per, n)
            for s in range(0, q, piece):
                t = min(s + piece, q)
                out[r:e, s:t] = native.decoder_stack(stack, x[r:e, s:t], batch.positions[r:e, s:t], batch.rows[r:e],
                                                     batch.cos[r:e, s:t], batch.sin[r:e, s:t], cache.k, cache.v, None)
        return out

    def native_stack(self) -> native.NativeStack | None:
        """Every layer as one C call (native.decoder_stack) where each layer is one
        (`DecoderLayer.native_layer`); rebuilt when any layer's is set anew (a benchmark or test
        may switch one off), which DecoderLayer.generation counts: comparing every layer's
        attribute at each step took ~18 us of a ~0.9 ms plain step at one row."""
        layers = self.model.layers
        key = (DecoderLayer.generation, len(layers))
        built_for, stack = self._native_stack
        if built_for != key:
            stack = native.stack_weights(layers)
            self._native_stack = (key, stack)     # None too: no stack is looked for again until they change
        return stack

    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Causal forward over whole sequences [B, T] from position 0, no cache (for training)."""
        b, t = input_ids.shape
        return self.forward(input_ids, Batch.from_start(b, t, input_ids.device), None)

    def output_linear(self):
        """The packed output projection `logits` runs (lm_head, or the tied embedding's), or None
        where it multiplies by the embedding in torch."""
        return self.lm_head if self.lm_head is not None else self.tied_head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab] in float32."""
        if self.lm_head is not None:
            return self.lm_head.forward(hidden).float()
        if self.tied_head is not None:
            return self.tied_head.forward(hidden).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()
