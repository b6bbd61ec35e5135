"""What the engine needs to know about a checkpoint, read from its Hugging Face config."""
from __future__ import annotations

from dataclasses import dataclass

# Architecture name in config.json -> the family traits our native forward implements.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=None, o_bias=None, qk_norm=False),  # None: config.attention_bias
    "MistralForCausalLM": dict(qkv_bias=False, o_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, o_bias=False, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=None, o_bias=None, qk_norm=True),
}


class UnsupportedArchitecture(ValueError):
    pass


@dataclass(frozen=True)
class ArchConfig:
    """A checkpoint's architecture (sizes, biases, windows, MTP layers); the run's `model.*`
    keys are pipeline.config.ModelConfig."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # per target layer; None = full attention
    num_mtp_layers: int                      # DeepSeek `num_nextn_predict_layers`
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf) -> "ArchConfig":
        """Build from a transformers PretrainedConfig; refuses architectures we do not run."""
        archs = list(getattr(hf, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedArchitecture(
                f"architecture {archs or '(none in config.json)'} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        traits = SUPPORTED_ARCHITECTURES[arch]
        attn_bias = bool(getattr(hf, "attention_bias", False))
        act = getattr(hf, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedArchitecture(f"hidden_act {act!r} is not supported (silu only)")
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        eos = getattr(hf, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=attn_bias if traits["qkv_bias"] is None else traits["qkv_bias"],
            o_bias=attn_bias if traits["o_bias"] is None else traits["o_bias"],
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=traits["qk_norm"],
            sliding_windows=_sliding_windows(hf),
            num_mtp_layers=int(getattr(hf, "num_nextn_predict_layers", 0) or 0),
            eos_token_ids=eos_ids,
        )


def _sliding_windows(hf) -> tuple[int | None, ...]:
    window = getattr(hf, "sliding_window", None)
    if hasattr(hf, "use_sliding_window") and not hf.use_sliding_window:
        window = None
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is None:
        return (window,) * hf.num_hidden_layers
    return tuple(window if t == "sliding_attention" else None for t in layer_types)
