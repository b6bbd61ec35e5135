"""MTP draft heads in the DeepSeek-V3 layout.

Head k at position i takes h_i (the previous depth's output; the target's final-norm'ed hidden
state for depth 1) and the token t_{i+1}, and predicts t_{i+2}:

    x   = eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)])
    out = decoder_layer(x)                      # the target's layer type, own KV cache
    logits = shared_head.head(shared_head.norm(out))

Checkpoint keys live under `model.layers.{num_hidden_layers + k}.*` with `num_nextn_predict_layers`
in config.json (DeepSeek-V3, GLM-4.5), so such a checkpoint still loads with plain transformers.
`shared_head.head` and `embed_tokens` fall back to the target's where the checkpoint omits them.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from pipeline.model import native
from pipeline.model.cache import Batch, KVCache
from pipeline.model.config import ArchConfig
from pipeline.model.layers import DecoderLayer, RMSNorm, native_step
from pipeline.model.packed import cpu_linear
from pipeline.model.target import TargetModel


class SharedHead(nn.Module):
    def __init__(self, cfg: ArchConfig, with_head: bool):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if with_head else None


class MTPHead(DecoderLayer):
    def __init__(self, cfg: ArchConfig, with_head: bool = False, with_embed: bool = False):
        super().__init__(cfg)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(cfg, with_head)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if with_embed else None
        self.vocab_size = cfg.vocab_size
        self._target: TargetModel | None = None
        self.draft_ids: torch.Tensor | None = None      # [Vd] the draft vocabulary (None: all V)
        self.draft_head: nn.Module | None = None        # [hidden] -> [Vd]: its rows of the output head
        self.native_head = None     # CPU inference: `forward` as one C call (native.head_weights), set by pack_linears_
        self._greedy = None         # (native_head, draft_head, its native.NativeDraft), made on first use

    def bind(self, target: TargetModel) -> "MTPHead":
        """Share the target's embedding, output head and rotary tables (not registered as params)."""
        object.__setattr__(self, "_target", target)
        return self

    @classmethod
    def from_target(cls, target: TargetModel, config: ArchConfig | None = None) -> "MTPHead":
        """A fresh head (std 0.02 linears, norms copied from the target's final norm)."""
        cfg = config or target.cfg
        ref = target.model.norm.weight
        head = cls(cfg).to(device=ref.device, dtype=ref.dtype)
        for module in head.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        with torch.no_grad():
            head.shared_head.norm.weight.copy_(target.model.norm.weight)
        return head.bind(target)

    def forward(self, prev_hidden: torch.Tensor, next_ids: torch.Tensor, batch: Batch,
                cache: KVCache | None, layer: int = 0) -> torch.Tensor:
        """prev_hidden: [n, q, hidden] (h_i); next_ids: [n, q] (t_{i+1}). Returns [n, q, hidden]."""
        target = self._target
        target.attach_rope(batch)
        nh = self.native_head
        if nh is not None and native_step(prev_hidden, batch, cache, nh.max_tokens):
            return native.mtp_forward(nh, prev_hidden, next_ids, batch.positions, None if batch.prefix else batch.rows,
                                      batch.cos, batch.sin, cache.k[layer], cache.v[layer], batch.key_valid)
        emb = self.embed_tokens(next_ids) if self.embed_tokens is not None else target.embed(next_ids)
        x = self.eh_proj.forward(torch.cat([self.enorm.forward(emb), self.hnorm.forward(prev_hidden)], dim=-1))
        return self.block(x, batch, cache, layer)

    def attach_native_(self) -> None:
        """CPU inference, linears packed: the layer and the whole forward as C calls where they can be."""
        super().attach_native_()
        table = self.embed_tokens.weight if self.embed_tokens is not None else self._target.model.embed_tokens.weight
        self.native_head = native.head_weights(self, table.detach())

    def forward_full(self, prev_hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Causal forward over whole sequences from position 0, no cache (for training)."""
        b, t = next_ids.shape
        return self.forward(prev_hidden, next_ids, Batch.from_start(b, t, next_ids.device), None)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab] float32: the draft distribution's logits."""
        x = self.shared_head.norm(out)
        if self.shared_head.head is not None:
            return self.shared_head.head(x).float()
        return self._target.logits(x)

    def subset_logits(self, out: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., Vd] float32 logits at token ids `ids` [Vd]: `logits(out)[..., ids]`
        without computing the rest (heads trained over a draft vocabulary)."""
        weight = _output_weight(self.shared_head.head if self.shared_head.head is not None else self._target)
        return F.linear(self.shared_head.norm(out), weight[ids]).float()

    def draft_logits(self, out: torch.Tensor):
        """[n, hidden] -> (logits [n, Vd] float32, ids [Vd]) over the draft vocabulary, or
        (logits [n, V], None) without one (pipeline.model.draft_vocab)."""
        if self.draft_ids is None:
            return self.logits(out), None
        return self.draft_head.forward(self.shared_head.norm.forward(out)).float(), self.draft_ids

    def greedy_native(self):
        """This head's greedy drafting as C calls (native.draft_weights) for the draft vocabulary
        it has now, or None."""
        if self.native_head is None:
            return None
        g = self._greedy
        if g is None or g[0] is not self.native_head or g[1] is not self.draft_head:
            g = self._greedy = (self.native_head, self.draft_head, native.draft_weights(self))
        return g[2]

    def set_draft_vocab(self, ids: torch.Tensor | None) -> None:
        """Draft over token ids `ids` [Vd] (None: the full vocabulary). Inference only: the
        subset's output rows are copied (Vd x hidden), not tied to the trained weight."""
        if ids is None:
            self.draft_ids = self.draft_head = None
            return
        weight = _output_weight(self.shared_head.head if self.shared_head.head is not None else self._target)
        ids = ids.to(weight.device)
        self.draft_ids = ids
        # a plain attribute, not a submodule: the state dict stays the checkpoint's
        object.__setattr__(self, "draft_head", cpu_linear(weight.detach()[ids]))


def _output_weight(module) -> torch.Tensor:
    """The [V, hidden] output projection of a head's own linear or of the target."""
    if isinstance(module, TargetModel):
        if module.lm_head is None:
            return module.model.embed_tokens.weight
        module = module.lm_head
    return module.weight if hasattr(module, "weight") else module.weight_t.t()


def head_for_depth(num_heads: int, depth: int) -> int:
    """Index of the head that drafts depth `depth` (1-based); the last head is reused beyond K."""
    return min(depth, num_heads) - 1


def mtp_state_dict(heads, num_layers: int) -> dict[str, torch.Tensor]:
    """The heads' tensors under DeepSeek keys `model.layers.{num_layers + k}.*`."""
    out = {}
    for k, head in enumerate(heads):
        for name, tensor in head.state_dict().items():
            out[f"model.layers.{num_layers + k}.{name}"] = tensor.detach().cpu().contiguous()
    return out


def save_mtp_heads(checkpoint_dir: str | Path, heads) -> None:
    """Write `heads` into a checkpoint in DeepSeek naming, replacing any heads it had.

    A single-file checkpoint gets the tensors inside `model.safetensors`; a sharded one gets
    `model-mtp.safetensors` listed in its index. config.json gains `num_nextn_predict_layers`.
    """
    root = Path(checkpoint_dir)
    config_path = root / "config.json"
    config = json.loads(config_path.read_text())
    n = config["num_hidden_layers"]
    new = mtp_state_dict(heads, n)

    def is_mtp(key: str) -> bool:
        parts = key.split(".")
        return key.startswith("model.layers.") and int(parts[2]) >= n

    index_path = root / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not is_mtp(k)}
        save_file(new, str(root / "model-mtp.safetensors"), metadata={"format": "pt"})
        index["weight_map"].update({k: "model-mtp.safetensors" for k in new})
        index_path.write_text(json.dumps(index, indent=2))
    else:
        path = root / "model.safetensors"
        tensors = {k: v for k, v in load_file(str(path)).items() if not is_mtp(k)}
        tensors.update(new)
        tmp = root / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(path)
    config["num_nextn_predict_layers"] = len(heads)
    config_path.write_text(json.dumps(config, indent=2))
