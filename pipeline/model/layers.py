"""Llama-family building blocks with parameter names that match Hugging Face checkpoints.

Attention reads and writes a `KVCache` through a `Batch` (which cache rows, which positions),
so the same layer serves prefill, verify steps of gamma + 1 tokens, and MTP drafting.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.model.cache import Batch, KVCache
from pipeline.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, q, head_dim]; cos, sin: [n, q, head_dim]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = window
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: Batch, cache: KVCache | None, layer: int) -> torch.Tensor:
        n, q, _ = x.shape                                                   # x: [n, q, hidden]
        qs = self.q_proj(x).view(n, q, self.num_heads, self.head_dim)
        ks = self.k_proj(x).view(n, q, self.num_kv_heads, self.head_dim)
        vs = self.v_proj(x).view(n, q, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            qs, ks = self.q_norm(qs), self.k_norm(ks)
        qs = apply_rope(qs.transpose(1, 2), batch.cos, batch.sin)            # [n, heads, q, d]
        ks = apply_rope(ks.transpose(1, 2), batch.cos, batch.sin)            # [n, kv_heads, q, d]
        if cache is None:                      # full-sequence forward: attend over the fresh keys
            keys, values = ks, vs
        else:
            cache.write(layer, batch, ks, vs)
            keys, values = cache.read(layer, batch)                          # [n, kv_heads, T, d]
        out = F.scaled_dot_product_attention(
            qs, keys, values, attn_mask=batch.mask(self.window), enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(n, q, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def block(self, x: torch.Tensor, batch: Batch, cache: KVCache | None, layer: int) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))

    forward = block
