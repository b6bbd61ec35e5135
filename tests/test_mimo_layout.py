"""MiMo's `model.mtp_layers.N.*` layout loads as a DeepSeek-layout MTP head and matches a
reference computation of MiMo's MTP forward written here from its definition."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pipeline.model.mimo import mimo_key_to_deepseek, mimo_to_deepseek, swap_projection_halves
from pipeline.model.tiny import make_tiny_checkpoint

H, HEADS, KV, D, THETA, EPS = 64, 4, 2, 16, 10000.0, 1e-6


def rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x, pos):                                        # x: [B, heads, T, D]
    inv = 1.0 / THETA ** (torch.arange(0, D, 2).float() / D)
    ang = pos[:, None].float() * inv[None, :]            # [T, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def mimo_mtp_reference(p: dict, hidden: torch.Tensor, emb: torch.Tensor, lm_head: torch.Tensor):
    """MiMo MTP layer (Qwen2 decoder layer) from raw tensors `p` (names after mtp_layers.N.)."""
    b, t, _ = hidden.shape
    x = torch.cat([rms(hidden, p["hidden_layernorm.weight"]), rms(emb, p["token_layernorm.weight"])], -1)
    x = x @ p["input_proj.weight"].T
    a = rms(x, p["input_layernorm.weight"])
    q = (a @ p["self_attn.q_proj.weight"].T + p["self_attn.q_proj.bias"]).view(b, t, HEADS, D).transpose(1, 2)
    k = (a @ p["self_attn.k_proj.weight"].T + p["self_attn.k_proj.bias"]).view(b, t, KV, D).transpose(1, 2)
    v = (a @ p["self_attn.v_proj.weight"].T + p["self_attn.v_proj.bias"]).view(b, t, KV, D).transpose(1, 2)
    pos = torch.arange(t)
    q, k = rope(q, pos), rope(k, pos)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    att = (q @ k.transpose(-1, -2)) / D ** 0.5
    att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    x = x + (att @ v).transpose(1, 2).reshape(b, t, H) @ p["self_attn.o_proj.weight"].T
    m = rms(x, p["post_attention_layernorm.weight"])
    m = (F.silu(m @ p["mlp.gate_proj.weight"].T) * (m @ p["mlp.up_proj.weight"].T)) @ p["mlp.down_proj.weight"].T
    x = x + m
    return rms(x, p["final_layernorm.weight"]) @ lm_head.T


def mimo_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2          # noqa: E731
    n = lambda: 1.0 + 0.1 * torch.randn(H, generator=g)         # noqa: E731
    return {
        "token_layernorm.weight": n(), "hidden_layernorm.weight": n(),
        "input_proj.weight": r(H, 2 * H), "final_layernorm.weight": n(),
        "input_layernorm.weight": n(), "post_attention_layernorm.weight": n(),
        "self_attn.q_proj.weight": r(HEADS * D, H), "self_attn.q_proj.bias": r(HEADS * D),
        "self_attn.k_proj.weight": r(KV * D, H), "self_attn.k_proj.bias": r(KV * D),
        "self_attn.v_proj.weight": r(KV * D, H), "self_attn.v_proj.bias": r(KV * D),
        "self_attn.o_proj.weight": r(H, HEADS * D),
        "mlp.gate_proj.weight": r(128, H), "mlp.up_proj.weight": r(128, H), "mlp.down_proj.weight": r(H, 128),
    }


@pytest.fixture(scope="module")
def mimo_checkpoint(tmp_path_factory):
    """A tiny Qwen2 target (MiMo's family) with one MTP layer in MiMo naming."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("mimo"), arch="qwen2", num_mtp_layers=0,
                                hidden_size=H, num_heads=HEADS, num_kv_heads=KV, intermediate_size=128)
    tensors = load_file(str(path / "model.safetensors"))
    layer = mimo_tensors(seed=3)
    tensors.update({f"model.mtp_layers.0.{k}": v for k, v in layer.items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    return path, layer


def test_key_mapping_and_projection_swap():
    assert mimo_key_to_deepseek("token_layernorm.weight") == "enorm.weight"
    assert mimo_key_to_deepseek("hidden_layernorm.weight") == "hnorm.weight"
    assert mimo_key_to_deepseek("final_layernorm.weight") == "shared_head.norm.weight"
    assert mimo_key_to_deepseek("input_proj.weight") == "eh_proj.weight"
    assert mimo_key_to_deepseek("self_attn.q_proj.bias") == "self_attn.q_proj.bias"
    w = torch.randn(3, 6)
    a, b = torch.randn(3), torch.randn(3)
    torch.testing.assert_close(w @ torch.cat([a, b]), swap_projection_halves(w) @ torch.cat([b, a]))
    out = mimo_to_deepseek({"model.mtp_layers.1.input_proj.weight": w, "model.norm.weight": a}, 4)
    assert set(out) == {"model.layers.5.eh_proj.weight", "model.norm.weight"}


def test_mimo_checkpoint_loads_and_matches_reference(mimo_checkpoint):
    from transformers import AutoModelForCausalLM

    from pipeline.model.loader import load_model
    path, layer = mimo_checkpoint
    loaded = load_model(path)
    assert len(loaded.heads) == 1
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = hf.model(input_ids=ids).last_hidden_state             # [2, 9, H] final-normed
        emb = hf.model.embed_tokens(ids[:, 1:])                         # t_{i+1}
        want = mimo_mtp_reference(layer, hidden[:, :-1], emb, hf.lm_head.weight)
        head = loaded.heads[0]
        got = head.logits(head.forward_full(loaded.target.forward_full(ids)[:, :-1], ids[:, 1:]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
