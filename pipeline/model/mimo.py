"""MiMo's native MTP layout, mapped onto the DeepSeek layout that `MTPHead` reads.

MiMo-7B stores MTP layer k under `model.mtp_layers.{k}.*`:

    x   = input_proj(cat[hidden_layernorm(h_i), token_layernorm(embed(t_{i+1}))])
    x   = decoder_layer(x)        # input_layernorm, self_attn.*, post_attention_layernorm, mlp.*
    out = final_layernorm(x); logits = lm_head(out)

DeepSeek-V3 (`pipeline.model.mtp`) projects cat[enorm(embed), hnorm(hidden)], the reverse order,
so the two column halves of `input_proj.weight` [H, 2H] swap to give `eh_proj.weight`:

    eh_proj.weight = cat[input_proj.weight[:, H:], input_proj.weight[:, :H]]

Renames: token_layernorm -> enorm, hidden_layernorm -> hnorm, final_layernorm ->
shared_head.norm; the decoder layer's own names are the same in both layouts. The result keys
are `model.layers.{num_hidden_layers + k}.*`. Depth 1 is exact. (MiMo passes the
final-normed output on to a chained depth, DeepSeek the un-normed one; with one MTP layer, as
MiMo-7B ships, drafting deeper reuses the head either way.)
"""
from __future__ import annotations

import re

import torch

_MIMO_KEY = re.compile(r"^model\.mtp_layers\.(\d+)\.(.+)$")
_RENAMES = {
    "token_layernorm.": "enorm.",
    "hidden_layernorm.": "hnorm.",
    "final_layernorm.": "shared_head.norm.",
    "input_proj.": "eh_proj.",
}


def swap_projection_halves(weight: torch.Tensor) -> torch.Tensor:
    """[H, 2H] weight over cat[a, b] -> the weight over cat[b, a] (same map, inputs swapped)."""
    h = weight.shape[1] // 2
    return torch.cat([weight[:, h:], weight[:, :h]], dim=1).contiguous()


def mimo_key_to_deepseek(name: str) -> str:
    """A MiMo MTP-layer parameter name (after `model.mtp_layers.N.`) -> the DeepSeek head name."""
    for old, new in _RENAMES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def mimo_to_deepseek(tensors: dict[str, torch.Tensor], num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """Return `tensors` with every `model.mtp_layers.{k}.*` replaced by its DeepSeek-layout
    equivalent `model.layers.{num_hidden_layers + k}.*`; other tensors pass through."""
    out = {}
    for key, value in tensors.items():
        m = _MIMO_KEY.match(key)
        if m is None:
            out[key] = value
            continue
        k, name = int(m.group(1)), m.group(2)
        new = mimo_key_to_deepseek(name)
        if name == "input_proj.weight":
            value = swap_projection_halves(value)
        elif name.startswith("input_proj."):
            raise ValueError(f"unexpected MiMo tensor {key} (input_proj has no bias in MiMo)")
        out[f"model.layers.{num_hidden_layers + k}.{new}"] = value
    return out
