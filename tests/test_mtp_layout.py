"""An MTP head stored in DeepSeek-V3 naming computes the DeepSeek formula, checked against a
reference built here from plain tensors and transformers' own decoder layer."""
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from pipeline.model.config import UnsupportedArchitecture
from pipeline.model.loader import load_model
from tests.tiny_models import tiny_checkpoint

H, V = 64, 128


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _write_deepseek_head(path, with_head: bool, with_embed: bool, seed: int = 0):
    """Add `model.layers.{N}.*` tensors in DeepSeek naming to a checkpoint without heads."""
    config = json.loads((path / "config.json").read_text())
    n = config["num_hidden_layers"]
    tensors = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    shapes = {k.split("model.layers.0.", 1)[1]: v.shape for k, v in tensors.items() if k.startswith("model.layers.0.")}
    head = {name: torch.randn(shape, generator=gen) * 0.2 for name, shape in shapes.items()}
    head.update({"enorm.weight": 1 + 0.1 * torch.randn(H, generator=gen),
                 "hnorm.weight": 1 + 0.1 * torch.randn(H, generator=gen),
                 "eh_proj.weight": torch.randn(H, 2 * H, generator=gen) * 0.1,
                 "shared_head.norm.weight": 1 + 0.1 * torch.randn(H, generator=gen)})
    if with_head:
        head["shared_head.head.weight"] = torch.randn(V, H, generator=gen) * 0.2
    if with_embed:
        head["embed_tokens.weight"] = torch.randn(V, H, generator=gen) * 0.2
    tensors.update({f"model.layers.{n}.{k}": v.contiguous() for k, v in head.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return head, tensors, n


@pytest.mark.parametrize("with_head,with_embed", [(False, False), (True, True)])
@torch.no_grad()
def test_deepseek_named_head_matches_reference(tmp_path, with_head, with_embed):
    path = tmp_path / "ckpt"
    tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=0, with_tokenizer=False)
    import shutil
    src = next(p for p in tmp_path.iterdir() if p.name != "ckpt")
    shutil.copytree(src, path)
    head_w, all_w, n = _write_deepseek_head(path, with_head, with_embed)
    m = load_model(path)
    assert len(m.heads) == 1 and m.config.num_mtp_layers == 1

    hf_config = transformers.AutoConfig.from_pretrained(str(path))
    eps = hf_config.rms_norm_eps
    t = 9
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(1, t, H, generator=gen)                 # h_i from the target
    nxt = torch.randint(0, V, (1, t), generator=gen)        # t_{i+1}

    # Reference: x = eh_proj(cat[enorm(embed(t_{i+1})), hnorm(h_i)]); decoder layer; shared head.
    embed = head_w["embed_tokens.weight"] if with_embed else all_w["model.embed_tokens.weight"]
    x = torch.cat([_rms(embed[nxt], head_w["enorm.weight"], eps), _rms(h, head_w["hnorm.weight"], eps)], -1)
    x = x @ head_w["eh_proj.weight"].T
    layer = LlamaDecoderLayer(hf_config, layer_idx=0).eval()
    layer.load_state_dict({k: v for k, v in head_w.items() if k.split(".")[0] in
                           ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")})
    pos = torch.arange(t)[None]
    cos, sin = LlamaRotaryEmbedding(hf_config)(x, pos)
    causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out_ref = layer(x, attention_mask=causal, position_ids=pos, position_embeddings=(cos, sin))
    out_ref = out_ref[0] if isinstance(out_ref, tuple) else out_ref
    normed = _rms(out_ref, head_w["shared_head.norm.weight"], eps)
    lm_head = head_w["shared_head.head.weight"] if with_head else all_w["lm_head.weight"]
    logits_ref = normed @ lm_head.T

    head = m.heads[0]
    out = head.forward_full(h, nxt)
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head.logits(out), logits_ref, rtol=1e-4, atol=1e-4)

    # The checkpoint still loads with plain transformers (the head's keys are ignored there).
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    ids = torch.randint(0, V, (1, 6), generator=gen)
    torch.testing.assert_close(hf(ids).logits, m.target.logits(m.target.forward_full(ids)), rtol=1e-4, atol=1e-4)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2"
    path.mkdir()
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, architectures=["GPT2LMHeadModel"]).save_pretrained(str(path))
    save_file({"x": torch.zeros(1)}, str(path / "model.safetensors"))
    with pytest.raises(UnsupportedArchitecture, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        load_model(path)


def test_pickle_checkpoint_is_refused(tmp_path):
    src = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=0, with_tokenizer=False)
    import shutil
    path = tmp_path / "pickled"
    shutil.copytree(src, path)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pickle weights"):
        load_model(path)
