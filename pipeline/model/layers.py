"""Llama-family building blocks with parameter names that match Hugging Face checkpoints.

Attention reads and writes a `KVCache` through a `Batch` (which cache rows, which positions),
so the same layer serves prefill, verify steps of gamma + 1 tokens, and MTP drafting.

The inference path (fused projections) calls submodules through `.forward`, not
`nn.Module.__call__` (no hooks are used): at batch 1 on a CPU a step is ~40 small ops a layer,
and `__call__`'s 2-4 us each were 7-9% of a demo step (docs/decisions.md, 2026-12-05). Flags
like `fused` are plain attributes for the same reason (`hasattr` on a missing submodule raises
inside `nn.Module.__getattr__`). On a CPU where pipeline.model.native builds, a step's layer is
one C call (`DecoderLayer.native_layer`), or its attention is (`Attention.native`): the ops
above cost more than a demo layer's arithmetic (docs/decisions.md, stop 50).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model import native
from pipeline.model.cache import Batch, KVCache
from pipeline.model.config import ArchConfig


NATIVE_NORM_ROWS = 64      # rows up to which a CPU norm takes the C kernel (a step's, not a prefill's)
NATIVE_ATTN_TOKENS = 512   # query tokens up to which a cached CPU attention takes the C kernel: a step's
                           # (batch 48 at gamma 9); measured faster than SDPA up to 96 with 1 and 2 threads


def native_step(x: torch.Tensor, batch: Batch, cache: KVCache | None, max_tokens: int | None = None) -> bool:
    """Whether a forward of x [n, q, ...] takes the C kernels (pipeline.model.native): a cached
    step, not a prefill from position 0, that `native_tokens` allows."""
    return not batch.from_zero and native_tokens(x, cache, max_tokens)


def native_tokens(x: torch.Tensor, cache: KVCache | None, max_tokens: int | None = None) -> bool:
    """x [n, q, ...] in float32 with a float32 cache, at most NATIVE_ATTN_TOKENS tokens and
    `max_tokens` (None: any), with no gradient wanted: what the C kernels take."""
    n = x.shape[0] * x.shape[1]
    return (cache is not None and x.dtype == cache.k.dtype == torch.float32
            and n <= NATIVE_ATTN_TOKENS and (max_tokens is None or n <= max_tokens) and not x.requires_grad)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.native = None     # CPU inference: the C kernels (pipeline.model.native), set by pack_linears_

    def takes_native(self, x: torch.Tensor) -> bool:
        """Whether `forward` runs the C kernel for x: float32, a step's few rows, no gradient."""
        return (self.native is not None and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and x.numel() <= NATIVE_NORM_ROWS * x.shape[-1] and not x.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32, scale in the input dtype (as transformers' Llama does); in
        # float32 one fused call gives the same bits, and the C kernel one call for a few rows
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if self.takes_native(x):
                return native.rms_norm(x, self.weight, self.eps, self.native)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def fold_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., head_dim] with its first half negated: the sign of transformers' `rotate_half`
    moved into the table, so `apply_rope` needs a roll instead of a chunk, a negation and a cat."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_folded: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, q, head_dim]; cos, sin_folded (`fold_sin`): [n, q, head_dim].
    transformers' x * cos + rotate_half(x) * sin, bit for bit: rotate_half(x) = [-x2, x1], and
    [x2, x1] * [-sin1, sin2] holds the same products."""
    return x * cos.unsqueeze(1) + x.roll(x.shape[-1] // 2, -1) * sin_folded.unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig, window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = window
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=cfg.o_bias)
        self.fused = False
        self.native = None     # CPU inference: the C kernels (pipeline.model.native), set by pack_linears_
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def fuse_(self) -> None:
        """Inference only: one q|k|v projection instead of three (fewer kernel launches)."""
        parts = (self.q_proj, self.k_proj, self.v_proj)
        fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=parts[0].bias is not None)
        fused = fused.to(device=parts[0].weight.device, dtype=parts[0].weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([p.weight for p in parts]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([p.bias for p in parts]))
        self.qkv_proj = fused
        self.fused = True
        del self.q_proj, self.k_proj, self.v_proj

    def _project(self, x: torch.Tensor, batch: Batch):
        """q [n, heads, q, d], k and v [n, kv_heads, q, d], RoPE applied to q and k."""
        n, q, _ = x.shape                                                   # x: [n, q, hidden]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.fused:
            qkv = self.qkv_proj.forward(x).view(n, q, hq + 2 * hk, d)
            if not self.qk_norm:                             # one RoPE call for q and k together
                qk = apply_rope(qkv[:, :, :hq + hk].transpose(1, 2), batch.cos, batch.sin)
                return qk[:, :hq], qk[:, hq:], qkv[:, :, hq + hk:].transpose(1, 2)
            qs, ks, vs = qkv.split([hq, hk, hk], dim=2)
        else:
            qs = self.q_proj(x).view(n, q, hq, d)
            ks = self.k_proj(x).view(n, q, hk, d)
            vs = self.v_proj(x).view(n, q, hk, d)
        if self.qk_norm:
            qs, ks = self.q_norm(qs), self.k_norm(ks)
        qs = apply_rope(qs.transpose(1, 2), batch.cos, batch.sin)
        ks = apply_rope(ks.transpose(1, 2), batch.cos, batch.sin)
        return qs, ks, vs.transpose(1, 2)

    def forward(self, x: torch.Tensor, batch: Batch, cache: KVCache | None, layer: int) -> torch.Tensor:
        n, q, _ = x.shape
        if self.native is not None and self.fused and not self.qk_norm and native_step(x, batch, cache):
            # a step's tokens: RoPE, cache write and attention in one C call
            qkv = self.qkv_proj.forward(x)
            out = native.attend(qkv, batch.cos, batch.sin, batch.positions, None if batch.prefix else batch.rows,
                                cache.k[layer], cache.v[layer], batch.key_valid, self.window, self.num_heads,
                                self.native)
            return self.o_proj.forward(out)
        qs, ks, vs = self._project(x, batch)
        if cache is None:                      # full-sequence forward: attend over the fresh keys
            keys, values = ks, vs
        else:
            cache.write(layer, batch, ks, vs)
            keys, values = cache.read(layer, batch)                          # [n, kv_heads, T, d]
        mask = batch.mask(self.window, qs.dtype)
        out = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=mask, is_causal=mask is None,
            enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj.forward(out.transpose(1, 2).reshape(n, q, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.fused = False

    def fuse_(self) -> None:
        """Inference only: one gate|up projection instead of two."""
        g, u = self.gate_proj, self.up_proj
        fused = nn.Linear(g.in_features, 2 * g.out_features, bias=g.bias is not None)
        fused = fused.to(device=g.weight.device, dtype=g.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([g.weight, u.weight]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([g.bias, u.bias]))
        self.gate_up_proj = fused
        self.fused = True
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
            return self.down_proj.forward(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    generation = 0      # bumped whenever any layer's native_layer is set (TargetModel.native_stack rebuilds then)

    def __init__(self, cfg: ArchConfig, window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.native_layer = None   # CPU inference: the whole layer as one C call (native.layer_weights), set by pack_linears_

    @property
    def native_layer(self):
        return self._native_layer

    @native_layer.setter
    def native_layer(self, value) -> None:
        self._native_layer = value
        DecoderLayer.generation += 1

    def block(self, x: torch.Tensor, batch: Batch, cache: KVCache | None, layer: int) -> torch.Tensor:
        nl = self.native_layer
        if nl is not None and native_step(x, batch, cache, nl.max_tokens):
            return native.decoder_layer(nl, x, batch.positions, None if batch.prefix else batch.rows, batch.cos,
                                        batch.sin, cache.k[layer], cache.v[layer], batch.key_valid)
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), batch, cache, layer)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x))

    forward = block

    def attach_native_(self) -> None:
        """CPU inference, linears packed: the layer as one C call where it can be (native.layer_weights)."""
        self.native_layer = native.layer_weights(self)

    def fuse_(self) -> None:
        self.self_attn.fuse_()
        self.mlp.fuse_()
