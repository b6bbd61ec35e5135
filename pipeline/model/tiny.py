"""Tiny random checkpoints with MTP heads, for tests and smoke benchmarks (seconds on a CPU)."""
from __future__ import annotations

from pathlib import Path

import torch

ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
}

_CORPUS = (
    "def add(a, b):\n    return a + b\n\n"
    "the quick brown fox jumps over the lazy dog. "
    "speculative decoding drafts tokens and the target verifies them in one pass. "
    "class Stack:\n    def push(self, item):\n        self.items.append(item)\n"
) * 4


def make_tiny_checkpoint(path, arch: str = "llama", num_mtp_layers: int = 1, seed: int = 0,
                         with_tokenizer: bool = True, vocab_size: int = 128, hidden_size: int = 64,
                         num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                         intermediate_size: int = 128, max_position_embeddings: int = 512,
                         initializer_range: float = 0.2, eos_token_id: int = 2,
                         tie_word_embeddings: bool = False, draftable: float | None = None) -> Path:
    """Write a random `arch` checkpoint (config.json, model.safetensors, tokenizer) with
    `num_mtp_layers` random DeepSeek-layout MTP heads. Returns the directory.

    draftable: None gives fully random weights (drafts almost never accepted). A float in (0, 1]
    builds a target that mostly maps each token to a fixed successor, perturbed by its attention
    and MLP scaled by `draftable`, and heads that predict that map: acceptance is high but not
    total, so tests see rows accept none, some and all drafts in one step."""
    import transformers
    from pipeline.model.loader import load_model
    from pipeline.model.mtp import MTPHead, save_mtp_heads

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config_cls, model_cls, extra = ARCH_CONFIGS[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range, bos_token_id=1, eos_token_id=eos_token_id, pad_token_id=0,
        tie_word_embeddings=tie_word_embeddings, **extra)
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    if draftable is not None:
        _make_target_draftable(model, draftable, seed)
    model.save_pretrained(str(root))
    if with_tokenizer:
        make_tiny_tokenizer(vocab_size).save_pretrained(str(root))
    if num_mtp_layers:
        loaded = load_model(root)
        torch.manual_seed(seed + 1)
        heads = [MTPHead.from_target(loaded.target) for _ in range(num_mtp_layers)]
        for head in heads:   # same spread as the target's weights, so drafts are not all ties
            for p in head.parameters():
                if p.dim() == 2:
                    torch.nn.init.normal_(p, std=initializer_range)
            if draftable is not None:
                _make_head_draftable(head, draftable)
        save_mtp_heads(root, heads)
    return root


def make_tiny_tokenizer(vocab_size: int):
    """A byte-level BPE with <pad>=0, <s>=1, </s>=2, trained on a fixed snippet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet())[:64])
    tok.train_from_iterator([_CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@torch.no_grad()
def _scale_blocks(attn_out: torch.nn.Linear, mlp_out: torch.nn.Linear, scale: float) -> None:
    attn_out.weight.mul_(scale)
    mlp_out.weight.mul_(scale)


@torch.no_grad()
def _make_target_draftable(model, scale: float, seed: int) -> None:
    """Output head = the embedding of a fixed random successor of each token; blocks scaled down."""
    gen = torch.Generator().manual_seed(seed + 7)
    emb = model.model.embed_tokens.weight
    model.lm_head.weight.copy_(emb[torch.randperm(emb.shape[0], generator=gen)])
    for layer in model.model.layers:
        _scale_blocks(layer.self_attn.o_proj, layer.mlp.down_proj, scale)


@torch.no_grad()
def _make_head_draftable(head, scale: float) -> None:
    """eh_proj passes the token embedding through, so the head predicts the successor map."""
    h = head.eh_proj.weight.shape[0]
    head.eh_proj.weight.mul_(scale).add_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
    _scale_blocks(head.self_attn.o_proj, head.mlp.down_proj, scale)
