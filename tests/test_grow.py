"""Depth up-scaling (pipeline.demo.grow): a grown checkpoint starts as the same function, then trains."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from pipeline.demo.grow import ZEROED, grow_checkpoint, grown_state_dict, layer_sources
from tests.tiny_models import tiny_checkpoint


def test_layer_sources_keep_order_and_spread_the_new_layers():
    assert layer_sources(4, 12) == [(i, j > 0) for i in range(4) for j in range(3)]
    assert layer_sources(4, 6) == [(0, False), (0, True), (1, False), (1, True), (2, False), (3, False)]
    assert layer_sources(2, 2) == [(0, False), (1, False)]
    with pytest.raises(ValueError):
        layer_sources(4, 3)


def test_new_layers_copy_their_source_with_zero_output_projections():
    w = {"model.embed_tokens.weight": torch.ones(3, 2), "model.norm.weight": torch.ones(2)}
    for i in range(2):
        for name in ZEROED + ("self_attn.q_proj.weight",):
            w[f"model.layers.{i}.{name}"] = torch.full((2, 2), float(i + 1))
    w["model.layers.2.eh_proj.weight"] = torch.ones(2, 4)          # an MTP head: dropped
    g = grown_state_dict(w, 2, 5)                                   # sources [0, 0, 0, 1, 1]
    assert not any(k.startswith("model.layers.5") or "eh_proj" in k for k in g)
    assert g["model.layers.1.self_attn.q_proj.weight"].eq(1).all()   # copied from layer 0
    assert g["model.layers.3.self_attn.q_proj.weight"].eq(2).all()   # trained layer 1, moved
    for j, new in [(0, False), (1, True), (2, True), (3, False), (4, True)]:
        for name in ZEROED:
            assert g[f"model.layers.{j}.{name}"].eq(0).all() == new
    assert g["model.norm.weight"] is w["model.norm.weight"]


def test_grown_checkpoint_computes_the_same_logits_and_greedy_text(tmp_path):
    src = tiny_checkpoint(str(tmp_path / "src"), num_mtp_layers=1)
    out = grow_checkpoint(Path(src), tmp_path / "grown", 5)
    a = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    b = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert b.config.num_hidden_layers == 5 and a.config.num_hidden_layers < 5
    assert getattr(b.config, "num_nextn_predict_layers", 0) in (0, None)    # the heads stayed behind
    ids = torch.randint(3, a.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(b(ids).logits, a(ids).logits, rtol=0, atol=1e-5)
        ga = a.generate(ids[:1], max_new_tokens=8, do_sample=False)
        gb = b.generate(ids[:1], max_new_tokens=8, do_sample=False)
    assert ga.tolist() == gb.tolist()
    # the new blocks train: one step moves their zeroed projections off zero
    b.train()
    b(ids, labels=ids).loss.backward()
    new_o = b.model.layers[1].self_attn.o_proj.weight
    assert new_o.eq(0).all() and new_o.grad is not None and new_o.grad.abs().sum() > 0
