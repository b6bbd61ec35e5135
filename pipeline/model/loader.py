"""Load a Hugging Face checkpoint directory (config.json + safetensors) into target + MTP heads."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from pipeline.model.config import ArchConfig
from pipeline.model.draft_vocab import load_draft_vocab
from pipeline.model.mtp import MTPHead
from pipeline.model.packed import pack_linears_, packing_pays
from pipeline.model.target import TargetModel

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass
class LoadedModel:
    target: TargetModel
    heads: nn.ModuleList          # MTP heads, depth 1..K
    config: ArchConfig
    hf_config: object
    path: Path
    draft_vocab: torch.Tensor | None = None   # [Vd] ids the heads draft over (None: all of V)


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, str(dtype))


def read_tensors(root: Path, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint's safetensors files. Pickle checkpoints (*.bin, *.pt) are
    refused unless `allow_pickle` (config `model.allow_pickle`), and even then they are read
    with torch.load(weights_only=True), which unpickles tensors and containers only."""
    files = sorted(root.glob("*.safetensors"))
    if not files:
        pickles = sorted(root.glob("*.bin")) + sorted(root.glob("*.pt"))
        if pickles and allow_pickle:
            return _read_pickles(pickles)
        hint = (f" (found pickle weights {[p.name for p in pickles]}: convert them to safetensors, "
                "or set model.allow_pickle=true if you trust them)") if pickles else ""
        raise FileNotFoundError(f"no *.safetensors weights in {root}{hint}")
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                tensors[key] = fh.get_tensor(key)
    return tensors


def _read_pickles(files: list[Path]) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in files:
        state = torch.load(str(f), map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{f} does not hold a state dict of tensors")
        tensors.update(state)
    return tensors


def split_mtp(tensors: dict[str, torch.Tensor], num_layers: int):
    """Split DeepSeek-layout checkpoints: `model.layers.{i}` with i >= num_layers are MTP heads."""
    target, heads = {}, {}
    for key, value in tensors.items():
        m = _LAYER_KEY.match(key)
        if m and int(m.group(1)) >= num_layers:
            heads.setdefault(int(m.group(1)) - num_layers, {})[m.group(2)] = value
        else:
            target[key] = value
    return target, [heads[k] for k in sorted(heads)]


def load_model(path, device="cpu", dtype=torch.float32, fuse: bool = False,
               allow_pickle: bool = False, draft_vocab: bool = True) -> LoadedModel:
    """fuse: merge q|k|v and gate|up projections for inference, and on CPU store linears
    transposed (pipeline.model.packed); the modules then no longer carry checkpoint names, so
    keep False to train or save. allow_pickle: see read_tensors."""
    root = Path(path)
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"model.path {root} is not a checkpoint directory (no config.json there)")
    dev = resolve_device(device) if isinstance(device, str) else device
    dt = resolve_dtype(dtype, dev)
    hf_config = AutoConfig.from_pretrained(str(root), trust_remote_code=False)
    tensors = read_tensors(root, allow_pickle=allow_pickle)
    tensors = _convert_foreign_mtp_layouts(tensors, hf_config)
    cfg = ArchConfig.from_hf(hf_config)
    target_sd, head_sds = split_mtp(tensors, cfg.num_layers)
    if cfg.tie_word_embeddings:
        target_sd.pop("lm_head.weight", None)
    for name in [k for k in target_sd if k.endswith("rotary_emb.inv_freq")]:
        target_sd.pop(name)
    with torch.device("meta"):
        target = TargetModel(cfg, hf_config)
    target.load_state_dict(target_sd, strict=True, assign=True)
    target = target.to(device=dev, dtype=dt).eval()
    target.init_rotary(dev)
    heads = nn.ModuleList()
    for sd in head_sds:
        with torch.device("meta"):
            head = MTPHead(cfg, with_head="shared_head.head.weight" in sd,
                           with_embed="embed_tokens.weight" in sd)
        if "shared_head.norm.weight" not in sd:          # fall back to the target's final norm
            sd["shared_head.norm.weight"] = target_sd["model.norm.weight"]
        head.load_state_dict(sd, strict=True, assign=True)
        heads.append(head.to(device=dev, dtype=dt).eval().bind(target))
    cfg = _with_mtp_count(cfg, len(heads))
    if fuse:
        for layer in [*target.model.layers, *heads]:
            layer.fuse_()
        if packing_pays(dev):
            target.pack_()
            for head in heads:
                pack_linears_(head)
    ids = load_draft_vocab(root, cfg.vocab_size) if heads and draft_vocab else None
    for head in heads:
        head.set_draft_vocab(ids)
    return LoadedModel(target, heads, cfg, hf_config, root, None if ids is None else ids.to(dev))


def _with_mtp_count(cfg: ArchConfig, k: int) -> ArchConfig:
    from dataclasses import replace
    return replace(cfg, num_mtp_layers=k)


def _convert_foreign_mtp_layouts(tensors: dict, hf_config) -> dict:
    """MiMo stores MTP layers as `model.mtp_layers.N.*`; map them to the DeepSeek layout."""
    if any(k.startswith("model.mtp_layers.") for k in tensors):
        from pipeline.model.mimo import mimo_to_deepseek
        return mimo_to_deepseek(tensors, hf_config.num_hidden_layers)
    return tensors
