"""Demo builder pieces: stdlib extraction, task formats, packing, and the shipped artefacts."""
from __future__ import annotations

import ast
import json
import random
from pathlib import Path

import pytest
import torch

from pipeline.demo.corpus import Example
from pipeline.demo.extract import function_record, heldout_bucket
from pipeline.demo.tasks import TEMPLATES, complete_split, prompt_for, signature_json, task_pairs
from pipeline.demo.train_base import BaseTrainSpec, block_tensors, lr_at, pack_blocks

ASSETS = Path(__file__).resolve().parents[1] / "pipeline" / "assets" / "demo"
SRC = '''class Box:
    def scale(self, factor=2, *, clamp=None):
        """Scale the box by a factor.

        More text.
        """
        w = self.w * factor
        h = self.h * factor
        if clamp is not None:
            w = min(w, clamp)
        return Box(w, h)
'''


def record(heldout_percent=0):
    tree = ast.parse(SRC)
    fn = tree.body[0].body[0]
    return function_record("m", "Box.scale", fn, SRC.splitlines(), heldout_percent)


def test_function_record_strips_docstring_and_dedents():
    r = record()
    assert r.summary == "Scale the box by a factor."
    assert r.source.startswith("def scale(self, factor=2, *, clamp=None):\n    \"\"\"Scale")
    assert '"""' not in r.code and r.code.splitlines()[1] == "    w = self.w * factor"
    assert r.header == "def scale(self, factor=2, *, clamp=None):"
    assert not r.heldout and record(100).heldout


def test_heldout_bucket_is_stable():
    assert heldout_bucket("def f():\n    return 1") == heldout_bucket("def f():\n    return 1")
    assert 0 <= heldout_bucket("x") < 100


def test_signature_json():
    got = json.loads(signature_json("def f(a, /, b=1, *args, c, d='x', **kw) -> int:"))
    assert got == {"name": "f", "parameters": ["a", "b", "*args", "c", "d", "**kw"],
                   "defaults": {"b": "1", "d": "'x'"}}
    assert signature_json("not python(") is None


def test_task_pairs_and_templates():
    r = record()
    pairs = {t: (text, ref) for t, text, ref in task_pairs(r)}
    assert set(pairs) == {"summarize", "complete", "json"}
    assert pairs["summarize"] == (r.code, " Scale the box by a factor.")
    start, rest = complete_split(r)
    assert start + rest == "\n".join(r.source.splitlines()[: len((start + rest).splitlines())])
    assert rest.startswith("\n")
    assert prompt_for("summarize", "X") == TEMPLATES["summarize"].format(text="X") == "Summarize:\nX\nSummary:"


def test_pack_blocks_keeps_examples_whole_and_weights_answers():
    exs = [Example([1] + [5] * n + [2], 1 if n % 2 else 3, "raw") for n in range(3, 40, 3)]
    blocks = pack_blocks(exs, 64, random.Random(0))
    assert sorted(i for b in blocks for i, _ in b) == list(range(len(exs)))
    for b in blocks:
        end = max(off + len(exs[i].ids) for i, off in b)
        assert end <= 64
    ids, targets, w = block_tensors(exs, blocks[0], 64, answer_weight=2.0)
    assert torch.equal(targets[:-1], ids[1:])
    for i, off in blocks[0]:
        ex = exs[i]
        assert ids[off] == 1 and (off == 0 or w[off - 1] == 0)      # bos is never a target
        want = [1.0] * (ex.answer_start - 1) + [2.0 if ex.answer_start > 1 else 1.0] * (len(ex.ids) - ex.answer_start)
        assert w[off: off + len(ex.ids) - 1].tolist() == want


def test_lr_schedule_warms_up_and_decays():
    s = BaseTrainSpec(steps=100, warmup=10, lr=1.0, min_lr_ratio=0.1)
    assert lr_at(0, s) == pytest.approx(0.1) and lr_at(9, s) == pytest.approx(1.0)
    assert lr_at(99, s) == pytest.approx(0.1, abs=1e-3)


@pytest.mark.skipif(not (ASSETS / "data" / "demo.parquet").exists(), reason="demo dataset not built")
def test_shipped_dataset_is_held_out_and_complete():
    import pyarrow.parquet as pq
    t = pq.read_table(str(ASSETS / "data" / "demo.parquet"))
    assert {"id", "task", "text", "reference"} <= set(t.column_names)
    rows = t.to_pylist()
    assert len(rows) >= 2000 and {r["task"] for r in rows} == {"summarize", "complete", "json"}
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["prompt"] == prompt_for(r["task"], r["text"]) and r["reference"]
        if r["task"] == "summarize":
            assert heldout_bucket(r["text"]) < 15     # held out by the build's split


@pytest.mark.skipif(not (ASSETS / "model" / "config.json").exists(), reason="demo model not built")
def test_shipped_model_loads_with_transformers_and_engine():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.model.loader import load_model
    size = sum(p.stat().st_size for p in (ASSETS / "model").iterdir())
    assert size < 25 * 1024 * 1024
    tok = AutoTokenizer.from_pretrained(str(ASSETS / "model"))
    model = AutoModelForCausalLM.from_pretrained(str(ASSETS / "model"), dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    loaded = load_model(ASSETS / "model")
    assert len(loaded.heads) >= 1
    ids = torch.tensor([tok("Summarize:\ndef f(x):\n    return x\nSummary:")["input_ids"]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = loaded.target.logits(loaded.target.forward_full(ids))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_base_training_resumes_from_its_checkpoint(tmp_path):
    from pipeline.demo.train_base import BaseModelSpec, train_base_model
    from pipeline.model.tiny import make_tiny_tokenizer
    torch.set_num_threads(1)
    tok = make_tiny_tokenizer(128)
    exs = [Example([1] + [(7 * i + j) % 120 + 3 for j in range(20)] + [2], 1) for i in range(40)]
    ms = BaseModelSpec(vocab_size=128, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                       intermediate_size=64, max_position_embeddings=64)
    spec = BaseTrainSpec(steps=2, batch_size=2, block_len=64, warmup=1, save_every=1, bf16=False)
    logs = []
    train_base_model(exs, tok, tmp_path / "a", tmp_path / "work", ms, spec, log=logs.append)
    train_base_model(exs, tok, tmp_path / "b", tmp_path / "work", ms,
                     BaseTrainSpec(**{**spec.__dict__, "steps": 4}), log=logs.append)
    assert any("resuming base training at step 2/4" in line for line in logs)
    state = torch.load(tmp_path / "work" / "base_train.pt", weights_only=True)
    assert state["step"] == 4 and (tmp_path / "b" / "model.safetensors").exists()


def test_mtp_prompts_follow_task_shares_and_the_split():
    from dataclasses import replace

    from pipeline.demo.mtp_prompts import _prompts
    base = record(0)
    recs = [replace(base, qualname=f"Box.scale{i}", heldout=i % 5 == 0) for i in range(100)]
    train = _prompts(recs, False, 40, seed=0, shares={"summarize": 0.5, "complete": 0.3, "json": 0.2})
    kinds = ["summarize" if p.startswith("Summarize:") else "json" if p.startswith("Signature:") else "complete"
             for p in train]
    assert (kinds.count("summarize"), kinds.count("complete"), kinds.count("json")) == (20, 12, 8)
    held = _prompts(recs, True, 300, seed=0)                   # only 20 held-out functions exist
    assert len(held) == 60
    assert _prompts(recs, False, 40, seed=0, shares={"summarize": 0.5, "complete": 0.3, "json": 0.2}) == train


def test_store_stage_halves_the_weights_and_loads_in_float32(tmp_path):
    """The build's store stage writes bfloat16 weights that float16 holds too; both loaders
    compute in float32 from them and agree with each other (the shipped demo is stored this way)."""
    import transformers

    from pipeline.demo.build import store_weights
    from pipeline.model.loader import load_model
    from pipeline.model.tiny import make_tiny_checkpoint
    torch.set_num_threads(1)
    path = make_tiny_checkpoint(tmp_path / "m", arch="llama", num_mtp_layers=1)
    before = (path / "model.safetensors").stat().st_size
    store_weights(path, "bfloat16", log=lambda _: None)
    assert (path / "model.safetensors").stat().st_size < 0.6 * before
    store_weights(path, "bfloat16", log=lambda _: pytest.fail("stored twice"))   # already stored: no-op
    from safetensors.torch import load_file

    from pipeline.model.packed import fp16_exact
    stored = load_file(str(path / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 and fp16_exact(t.float()) for t in stored.values())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    loaded = load_model(path)
    assert hf.dtype == torch.float32 and {p.dtype for p in loaded.target.parameters()} == {torch.float32}
    assert len(loaded.heads) == 1
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(loaded.target.logits(loaded.target.forward_full(ids)), hf(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_chunked_lm_loss_is_the_weighted_mean_cross_entropy():
    """Logits made a chunk at a time (chunks not dividing the tokens) give the loss of the whole
    [B, T, V] logits: sum of weight x cross-entropy over the sum of weights."""
    from pipeline.demo.train_base import chunked_lm_loss
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden, targets = torch.randn(3, 7, 8, generator=g), torch.randint(0, 11, (3, 7), generator=g)
    weights = torch.rand(3, 7, generator=g)
    ce = torch.nn.functional.cross_entropy(head(hidden).flatten(0, 1), targets.flatten(), reduction="none")
    want = (ce * weights.flatten()).sum() / weights.sum()
    for chunk in (1, 5, 21, 64):
        torch.testing.assert_close(chunked_lm_loss(hidden, head, targets, weights, chunk=chunk), want)


def test_eval_stage_reports_at_its_gamma_and_writes_the_prior_at_gamma_max(tmp_path):
    """The report is measured at `eval.gamma` (3, comparable across builds); spec_prior.json is
    measured again at the engine's gamma_max, so a fresh engine's "auto" has held-out acceptance
    at every depth it may run (a prior measured to depth 3 left depths 4-5 to a few unlucky drafts)."""
    import shutil

    from pipeline.demo.build import BuildSpec, build
    from pipeline.engine.params import DEFAULT_GAMMA_MAX
    from pipeline.model.spec_prior import read_spec_prior
    model = tmp_path / "model"
    shutil.copytree(ASSETS / "model", model)
    result = build(BuildSpec(work_dir=tmp_path / "work", model_dir=model, data_path=ASSETS / "data" / "demo.parquet",
                             stages=("eval",), threads=1,
                             eval={"rows_per_task": 2, "max_new_tokens": 12, "examples": 0}), log=lambda _: None)
    assert {r["gamma"] for r in result["acceptance"].values()} == {3}
    assert {r["gamma"] for r in result["prior_acceptance"].values()} == {DEFAULT_GAMMA_MAX}
    written = json.loads((model / "spec_prior.json").read_text())
    assert written["gamma"] == DEFAULT_GAMMA_MAX
    assert set(read_spec_prior(model)) == {"summarize", "complete", "json", "*"}
    shipped = json.loads((ASSETS / "model" / "spec_prior.json").read_text())
    assert shipped["gamma"] == DEFAULT_GAMMA_MAX
    assert all(len(t["reached"]) == DEFAULT_GAMMA_MAX and min(t["reached"]) > 0 for t in shipped["tasks"].values())


def test_storable_rounds_bfloat16_weights_to_values_float16_holds():
    """Below 2^-14 float16's grid is coarser than bfloat16's: such weights move by at most
    2^-25 and then survive a float16 round trip; larger ones, and tensors float16 cannot hold,
    keep their bfloat16 values."""
    from pipeline.demo.build import storable
    from pipeline.model.packed import fp16_exact
    t = torch.tensor([3.2e-6, -1.3e-7, 0.02, -0.7, 3.0])
    assert not fp16_exact(t.to(torch.bfloat16).float())                      # the tiny ones
    s = storable(t, torch.bfloat16)
    assert s.dtype == torch.bfloat16 and fp16_exact(s.float())
    assert (s.float() - t.to(torch.bfloat16).float()).abs().max() <= 2 ** -25
    assert torch.equal(s[2:], t[2:].to(torch.bfloat16))
    big = torch.tensor([1e5, 3.2e-6])
    assert torch.equal(storable(big, torch.bfloat16), big.to(torch.bfloat16))
    assert storable(t, torch.float16).dtype == torch.float16
