"""Depth up-scaling: a deeper Llama that starts as the function of a trained shallower one.

Each new decoder layer is a copy of the trained layer before it with its two output
projections (`self_attn.o_proj`, `mlp.down_proj`) set to zero, so the block adds nothing to the
residual stream and the grown model's logits equal the original's (LLaMA Pro, Wu et al. 2024;
the same idea as SOLAR's depth up-scaling). Training then turns the new blocks on. The demo uses
it to get a deep target (production MTP economics: one draft depth a small share of a step)
with the quality a shallow model reaches in the CPU time the build has (docs/decisions.md,
2026-12-02, stop 29).

Example: 4 trained layers grown to 12 put two new layers after each: source layers
[0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3], new = positions 1, 2, 4, 5, 7, 8, 10, 11.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")   # a new block's writes to the residual
LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def layer_sources(old_layers: int, new_layers: int) -> list[tuple[int, bool]]:
    """Per new layer: (the trained layer it copies, whether it is new). Each trained layer keeps
    its order and is followed by its share of the new ones (the first layers take the remainder).
    Example: 4 -> 6: [(0, F), (0, T), (1, F), (1, T), (2, F), (3, F)]."""
    if new_layers < old_layers:
        raise ValueError(f"cannot grow {old_layers} layers to {new_layers}")
    extra, rem = divmod(new_layers - old_layers, old_layers)
    out = []
    for i in range(old_layers):
        out.append((i, False))
        out.extend((i, True) for _ in range(extra + (i < rem)))
    return out


def grown_state_dict(state: dict[str, torch.Tensor], old_layers: int, new_layers: int) -> dict[str, torch.Tensor]:
    """The grown model's weights: layers renumbered per `layer_sources`, new layers' output
    projections zero, every other tensor (embeddings, final norm, ...) as it was. Keys of layers
    at or past `old_layers` (MTP heads in the DeepSeek layout) are dropped: heads are trained
    for the target they draft for."""
    out = {k: v for k, v in state.items() if not LAYER.match(k)}
    by_layer: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in state.items():
        m = LAYER.match(k)
        if m and int(m.group(1)) < old_layers:
            by_layer.setdefault(int(m.group(1)), {})[m.group(2)] = v
    for j, (src, new) in enumerate(layer_sources(old_layers, new_layers)):
        for name, v in by_layer[src].items():
            out[f"model.layers.{j}.{name}"] = torch.zeros_like(v) if new and name in ZEROED else v.clone()
    return out


def grow_checkpoint(src_dir: Path, out_dir: Path, new_layers: int) -> Path:
    """Write a `new_layers`-deep copy of the Llama checkpoint in src_dir (weights in float32,
    tokenizer alongside) to out_dir; transformers loads it as usual."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from safetensors.torch import load_file

    cfg = AutoConfig.from_pretrained(str(src_dir), trust_remote_code=False)
    old = cfg.num_hidden_layers
    state = {}
    for f in sorted(Path(src_dir).glob("*.safetensors")):
        state.update({k: v.float() for k, v in load_file(str(f)).items()})
    cfg.num_hidden_layers = new_layers
    if hasattr(cfg, "num_nextn_predict_layers"):     # the heads stay behind (grown_state_dict)
        delattr(cfg, "num_nextn_predict_layers")
    model = LlamaForCausalLM(cfg)
    grown = grown_state_dict(state, old, new_layers)
    if cfg.tie_word_embeddings:
        grown.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(grown, strict=False)
    missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"grown weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(str(src_dir)).save_pretrained(str(out_dir))
    return out_dir
