"""Draft vocabulary (pipeline/model/draft_vocab.py): the builder picks the corpus's frequent
tokens, the loader attaches a stored subset to the heads, heads draft inside it, and output is
unchanged: greedy identical to transformers, sampling the target's distribution."""
import json

import pytest
import torch

from pipeline.engine import Engine, SamplingParams
from pipeline.engine.drafter import Drafter
from pipeline.model.draft_vocab import (count_tokens, coverage, full_vocab_probs, load_draft_vocab,
                                        save_draft_vocab, top_tokens)
from pipeline.model.loader import load_model
from tests.stats_util import chi_square_pvalue
from tests.test_engine_sampling import NEW, PROMPT, TEMPERATURE, TOP_K, VOCAB, _counts, _exact_joint
from tests.tiny_models import hf_greedy, random_prompts, tiny_checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


def test_top_tokens_are_the_most_frequent_with_eos_kept():
    counts = torch.tensor([5, 0, 9, 1])
    assert top_tokens(counts, 2).tolist() == [0, 2]
    assert top_tokens(counts, 2, always=[3]).tolist() == [2, 3]
    assert top_tokens(torch.tensor([1, 1, 1]), 2).tolist() == [0, 1]          # ties: lower id
    with pytest.raises(ValueError):
        top_tokens(counts, 5)


def test_counts_and_coverage():
    counts = count_tokens([[1, 1, 2], torch.tensor([3, 1])], 5)
    assert counts.tolist() == [0, 3, 1, 1, 0]
    assert coverage(counts, torch.tensor([1, 3])) == pytest.approx(0.8)


def test_full_vocab_probs_scatters_q():
    q = torch.tensor([[0.25, 0.75]])
    assert full_vocab_probs(q, torch.tensor([1, 4]), 5).tolist() == [[0.0, 0.25, 0.0, 0.0, 0.75]]


def test_stored_vocab_is_loaded_onto_the_heads(root, tmp_path):
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=2, with_tokenizer=False)
    assert load_model(path, fuse=True).heads[0].draft_ids is None              # none stored: full V
    import shutil
    ckpt = shutil.copytree(path, tmp_path / "with_vocab")
    ids = torch.tensor([2, 5, 7, 40])
    save_draft_vocab(ckpt, ids, source="test", counts=torch.ones(128))
    assert json.loads((ckpt / "draft_vocab.json").read_text())["coverage"] == pytest.approx(4 / 128)
    loaded = load_model(ckpt, fuse=True)
    assert loaded.draft_vocab.tolist() == ids.tolist()
    assert all(h.draft_ids.tolist() == ids.tolist() for h in loaded.heads)
    assert load_model(ckpt, fuse=True, draft_vocab=False).heads[0].draft_ids is None
    (ckpt / "draft_vocab.json").write_text(json.dumps({"ids": [5, 2]}))
    with pytest.raises(ValueError, match="sorted"):
        load_draft_vocab(ckpt, 128)


@pytest.mark.parametrize("tied,fuse", [(False, True), (True, True), (True, False)])
def test_draft_logits_are_the_full_logits_at_the_subset(root, tied, fuse):
    path = tiny_checkpoint(root, arch="qwen3", num_mtp_layers=1, with_tokenizer=False, tie_word_embeddings=tied)
    head = load_model(path, fuse=fuse).heads[0]
    out = torch.randn(3, 64)
    ids = torch.tensor([0, 3, 17, 99, 127])
    with torch.no_grad():
        full = head.logits(out)
        head.set_draft_vocab(ids)
        sub, got = head.draft_logits(out)
    assert got is ids or got.tolist() == ids.tolist()
    assert sub.shape == (3, 5) and sub.dtype == torch.float32
    torch.testing.assert_close(sub, full[:, ids])


def _drafts_seen(monkeypatch):
    seen = []
    propose = Drafter.propose

    def spy(self, *args, **kwargs):
        drafts, probs = propose(self, *args, **kwargs)
        seen.append((drafts.clone(), None if probs is None else probs.clone()))
        return drafts, probs
    monkeypatch.setattr(Drafter, "propose", spy)
    return seen


def test_greedy_matches_transformers_with_a_draft_vocab(root, tmp_path, monkeypatch):
    import shutil
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=2, draftable=0.1, with_tokenizer=False)
    prompts = random_prompts([5, 9, 3, 12, 7, 1], 128, seed=1)
    refs = hf_greedy(path, prompts, 20)
    ckpt = shutil.copytree(path, tmp_path / "vocab")
    counts = count_tokens(refs, 128)
    ids = top_tokens(counts, 24, always=[2])
    assert coverage(counts, ids) < 1, "some target tokens must fall outside the subset"
    save_draft_vocab(ckpt, ids, source="test", counts=counts)
    engine = Engine.from_pretrained(ckpt, device="cpu", max_batch_size=4)
    assert engine.heads[0].draft_ids is not None
    seen = _drafts_seen(monkeypatch)
    for gamma in (1, 3):
        engine.reset_stats()
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=20), gamma=gamma)
        assert [o.token_ids for o in outs] == refs, f"gamma={gamma}"
        acc = engine.stats.acceptance_by_depth()
        assert 0 < acc[0] < 1, acc
    drafts = torch.cat([d.flatten() for d, _ in seen])
    assert drafts.numel() > 0 and torch.isin(drafts, ids).all()


@pytest.fixture(scope="module")
def sampling_setup(tmp_path_factory):
    import shutil
    base = tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt")), arch="llama", vocab_size=VOCAB,
                           num_mtp_layers=1, hidden_size=32, initializer_range=0.15, with_tokenizer=False)
    ckpt = shutil.copytree(base, tmp_path_factory.mktemp("vocab") / "ckpt")
    ids = torch.tensor([0, 2, 3, 5, 6])
    save_draft_vocab(ckpt, ids, source="test")
    return base, ckpt, ids


@pytest.mark.parametrize("verify", ["rejection", "coupled"])
def test_sampling_with_a_draft_vocab_matches_the_target_distribution(sampling_setup, monkeypatch, verify):
    base, ckpt, ids = sampling_setup
    engine = Engine.from_pretrained(ckpt, device="cpu", max_batch_size=2048)
    seen = _drafts_seen(monkeypatch)
    params = SamplingParams(max_new_tokens=NEW, temperature=TEMPERATURE, top_k=TOP_K, seed=11, ignore_eos=True,
                            verify=verify)
    counts = _counts(torch.tensor([o.token_ids for o in engine.generate([PROMPT] * 30000, params, gamma=3)]))
    exact = _exact_joint(base)
    for j in range(NEW):
        dims = tuple(d for d in range(NEW) if d != j)
        assert chi_square_pvalue(counts.sum(dims), exact.sum(dims)) > 1e-4, j
    for j in range(NEW - 1):
        dims = tuple(d for d in range(NEW) if d not in (j, j + 1))
        assert chi_square_pvalue(counts.sum(dims), exact.sum(dims)) > 1e-4, j
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    for drafts, probs in seen:
        assert torch.isin(drafts, ids).all()
        if verify == "rejection":
            assert probs.shape[-1] == VOCAB and (probs[..., outside] == 0).all()      # q scattered to V
        else:
            assert probs is None                     # the coupled rule needs no q
    acc = engine.stats.acceptance_by_depth()
    assert 0.05 < acc[0] < 0.95, acc


def test_build_draft_vocab_writes_the_top_tokens_and_removes_stale_ones(root, tmp_path):
    import shutil
    from pipeline.model.draft_vocab import build_draft_vocab
    ckpt = shutil.copytree(tiny_checkpoint(root, arch="llama", num_mtp_layers=1, with_tokenizer=False),
                           tmp_path / "ckpt")
    seqs = [[7, 7, 7, 9, 9, 4], [9, 7, 11]]
    path = build_draft_vocab(ckpt, seqs, 3, source="test", always=[2])
    info = json.loads(path.read_text())
    assert info["ids"] == [2, 7, 9] and info["coverage"] == pytest.approx(7 / 9)
    assert load_model(ckpt, fuse=True).heads[0].draft_ids.tolist() == [2, 7, 9]
    assert build_draft_vocab(ckpt, seqs, 0, source="test") is None
    assert not (ckpt / "draft_vocab.json").exists()
    assert load_model(ckpt, fuse=True).heads[0].draft_ids is None


def test_full_vocab_logits_pick_the_same_draft():
    logits = torch.tensor([[0.5, 2.0, -1.0]])
    ids = torch.tensor([1, 4, 6])
    from pipeline.model.draft_vocab import full_vocab_logits, to_full_vocab
    full = full_vocab_logits(logits, ids, 8)
    assert full.argmax(-1).tolist() == [4] == to_full_vocab(logits.argmax(-1), None, ids, 8)[0].tolist()
    assert torch.isinf(full[0, [0, 2, 3, 5, 7]]).all()
