"""MTP self-distillation on a tiny random checkpoint: loss falls, acceptance rises, and a
trained head written into the checkpoint and read back drafts the same tokens."""
from __future__ import annotations

import pytest
import torch

from pipeline.training.mtp_math import depth_weights, mtp_loss, teacher_forced_acceptance, unrolled_head_logits
from pipeline.training.train_mtp import MTPTrainSpec, collate, evaluate_heads, train_mtp_heads
from pipeline.model.loader import load_model
from pipeline.model.mtp import MTPHead, save_mtp_heads
from pipeline.model.tiny import make_tiny_checkpoint
from pipeline.spec_decode.policy import expected_tokens


@torch.no_grad()
def greedy(target, prompt: torch.Tensor, n: int) -> torch.Tensor:
    ids = prompt
    for _ in range(n):
        nxt = target.logits(target.forward_full(ids))[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), num_mtp_layers=0, seed=0)
    loaded = load_model(path)
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(6):                        # 6 x 8 sequences: 4 prompt + 20 greedy tokens
        prompt = torch.randint(3, 128, (8, 4), generator=g)
        seqs += [(row, 4) for row in greedy(loaded.target, prompt, 20)]
    return path, loaded, seqs[:40], seqs[40:]


def test_expected_tokens_and_depth_weights():
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1.75)
    assert expected_tokens([1.0, 1.0, 1.0], 3) == 4.0
    assert depth_weights(3, 0.5) == [1.0, 0.5, 0.25]


def test_unrolled_shapes_and_reuse(tiny):
    _, loaded, seqs, _ = tiny
    ids, _, _ = collate(seqs[:3], 1.0)
    head = MTPHead.from_target(loaded.target)
    hidden = loaded.target.forward_full(ids)
    out = unrolled_head_logits([head], hidden, ids, 3)
    assert [tuple(o.shape) for o in out] == [(3, ids.shape[1] - k, 128) for k in (1, 2, 3)]


def test_training_lowers_loss_and_raises_acceptance(tiny, tmp_path):
    _, loaded, train, held = tiny
    spec = MTPTrainSpec(num_heads=1, depths=2, steps=100, batch_size=8, lr=3e-3, warmup=5,
                        save_every=1000, bf16=False)
    target = loaded.target
    torch.manual_seed(0)
    fresh = torch.nn.ModuleList([MTPHead.from_target(target)])
    ids, w, gen = collate(train[:16], spec.gen_weight)
    with torch.no_grad():
        hidden = target.forward_full(ids)
        teacher = target.logits(hidden)
        before, _ = mtp_loss(fresh, hidden, teacher, ids, w, 2, 0.6, 0.5)
    # a random tiny target's greedy text is an arbitrary function of its context, so the check
    # is on the sequences trained on: the head must learn to draft what the target emits
    acc_before = evaluate_heads(target, fresh, train, 2)
    heads, acc_after = train_mtp_heads(loaded, train, train, spec, tmp_path)
    with torch.no_grad():
        after, _ = mtp_loss(heads, hidden, teacher, ids, w, 2, 0.6, 0.5)
    assert after.item() < 0.7 * before.item()
    assert acc_after[0] > acc_before[0] + 0.2
    assert expected_tokens(acc_after, 2) > expected_tokens(acc_before, 2)


def test_saved_heads_read_back_give_same_drafts(tiny, tmp_path):
    path, loaded, train, held = tiny
    spec = MTPTrainSpec(num_heads=2, depths=3, steps=10, batch_size=4, save_every=1000, bf16=False)
    heads, _ = train_mtp_heads(loaded, train, held, spec, tmp_path)
    save_mtp_heads(path, list(heads))
    again = load_model(path)
    assert len(again.heads) == 2 and again.config.num_mtp_layers == 2
    ids, _, gen = collate(held, 1.0)
    with torch.no_grad():
        a = unrolled_head_logits(heads, loaded.target.forward_full(ids), ids, 3)
        b = unrolled_head_logits(again.heads, again.target.forward_full(ids), ids, 3)
        for x, y in zip(a, b):
            assert torch.equal(x.argmax(-1), y.argmax(-1))
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
        h = again.target.forward_full(ids)
        acc = teacher_forced_acceptance(again.heads, h, again.target.logits(h), ids, gen, 3)
    assert acc == teacher_forced_acceptance(heads, h, loaded.target.logits(h), ids, gen, 3)


def test_train_mtp_recipe_writes_heads_into_checkpoint(tmp_path):
    """`+job=train_mtp` on a checkpoint without heads, prompts from a Parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    from pipeline.training.train_mtp import main
    path = make_tiny_checkpoint(tmp_path / "ckpt", num_mtp_layers=0, seed=1)
    pq.write_table(pa.table({"text": [f"def add{i}(a, b):" for i in range(12)]}), str(tmp_path / "p.parquet"))
    cfg = OmegaConf.create({
        "model": {"path": str(path), "device": "cpu"},
        "data": {"path": str(tmp_path / "p.parquet"), "template": "{text}", "prompt_column": "prompt"},
        "mtp": {"work_dir": str(tmp_path / "work"), "threads": 1, "prompt_source": "data",
                "num_heads": 1, "depths": 2, "steps": 3, "batch_size": 4, "num_prompts": 8,
                "num_eval": 4, "max_new_tokens": 6, "bf16": False, "draft_vocab_size": 64}})
    assert main(cfg) == 0
    loaded = load_model(path)
    assert len(loaded.heads) == 1
    assert loaded.draft_vocab.numel() == 64        # the subset the heads trained over is stored with them
    from pipeline.model.spec_prior import read_spec_prior
    prior = read_spec_prior(path)          # the heads' held-out acceptance ships with them
    assert prior and prior["*"][0][0] > 0 and all(a <= r for a, r in zip(prior["*"][1], prior["*"][0]))
    assert (tmp_path / "work" / "sequences.pt").exists() and (tmp_path / "work" / "mtp_train.pt").exists()


def test_cached_hidden_states_equal_the_per_step_forward(tiny):
    """The heads' training reads the frozen target's states from a once-computed cache; a
    batch stacked from it equals the target's forward over that batch on every real position."""
    from pipeline.training.train_mtp import cached_hidden, stack_hidden
    _, loaded, seqs, _ = tiny
    ragged = [(ids[: 10 + i], p) for i, (ids, p) in enumerate(seqs[:7])]   # lengths 10..16
    cache = cached_hidden(loaded.target, ragged, batch_size=3, bf16=False)
    assert [c.shape[0] for c in cache] == [len(ids) for ids, _ in ragged]
    picks = [6, 0, 3, 0]
    ids, w, _ = collate([ragged[i] for i in picks], 1.0)
    with torch.no_grad():
        want = loaded.target.forward_full(ids)
    got = stack_hidden([cache[i] for i in picks], ids.shape[1])
    real = w > 0
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)
    assert got[~real].eq(0).all()


def test_heads_train_over_the_draft_vocabulary(tiny):
    """Over a draft vocabulary the heads' logits are the full logits at the subset, the loss is
    KL to the teacher renormalised over it plus the argmax term where the teacher's argmax lies
    inside, and a draft is scored by its full-vocabulary id (as the engine drafts)."""
    import torch.nn.functional as F

    from pipeline.training.mtp_math import distill_loss, teacher_targets
    _, loaded, seqs, _ = tiny
    ids, w, gen = collate(seqs[:4], 1.0)
    torch.manual_seed(0)
    head = MTPHead.from_target(loaded.target)
    with torch.no_grad():
        hidden = loaded.target.forward_full(ids)
        teacher = loaded.target.logits(hidden)
        full = unrolled_head_logits([head], hidden, ids, 2)
        vocab = torch.arange(3, 128, 2)                       # every other token
        sub = unrolled_head_logits([head], hidden, ids, 2, vocab)
    for a, b in zip(full, sub):
        torch.testing.assert_close(b, a[..., vocab], rtol=1e-5, atol=1e-5)

    lg, tl, wt = sub[0], teacher[:, 1:], w[:, 1:]
    logp = F.log_softmax(tl[..., vocab], -1)
    logq = F.log_softmax(lg, -1)
    want = tl.argmax(-1)
    inside = (want[..., None] == vocab).any(-1)
    assert inside.any() and (~inside).any()                   # both cases occur in the check
    slot = (want[..., None] == vocab).float().argmax(-1)
    ce = -logq.gather(-1, slot[..., None]).squeeze(-1) * inside
    per_pos = (logp.exp() * (logp - logq)).sum(-1) + 0.5 * ce
    expect = (per_pos * wt).sum() / wt.sum()
    torch.testing.assert_close(distill_loss(lg, *teacher_targets(tl, vocab), wt, 0.5), expect)

    everything = torch.arange(128)                            # the whole vocabulary: the same as none
    torch.testing.assert_close(distill_loss(full[0], *teacher_targets(tl, everything), wt, 0.5),
                               distill_loss(full[0], *teacher_targets(tl), wt, 0.5))
    accs = [teacher_forced_acceptance([head], hidden, teacher, ids, gen, 2, v) for v in (None, everything)]
    assert accs[0] == accs[1]
    # a vocabulary without the teacher's tokens accepts nothing
    taken = set(teacher.argmax(-1).flatten().tolist())
    assert teacher_forced_acceptance([head], hidden, teacher, ids, gen, 2,
                                     torch.tensor(sorted(set(range(128)) - taken)))[0] == 0.0


def test_training_over_a_draft_vocabulary_raises_acceptance(tiny, tmp_path):
    _, loaded, train, _ = tiny
    from pipeline.model.draft_vocab import choose_draft_vocab
    vocab, counts = choose_draft_vocab([ids for ids, _ in train], 128, 48)
    assert vocab.numel() == 48 and counts.sum() == sum(len(ids) for ids, _ in train)
    spec = MTPTrainSpec(num_heads=1, depths=2, steps=100, batch_size=8, lr=3e-3, warmup=5,
                        save_every=1000, bf16=False)
    torch.manual_seed(0)
    fresh = torch.nn.ModuleList([MTPHead.from_target(loaded.target)])
    before = evaluate_heads(loaded.target, fresh, train, 2, vocab=vocab)
    _, after = train_mtp_heads(loaded, train, train, spec, tmp_path, vocab=vocab)
    assert after[0] > before[0] + 0.2


def test_loss_on_real_positions_only_equals_the_padded_loss(tiny):
    """The training step takes the output projections at weighted positions only (`keep`):
    the loss and its gradient are those of the padded batch."""
    _, loaded, seqs, _ = tiny
    ragged = [(s[: n], 4) for (s, _), n in zip(seqs[:4], (24, 9, 15, 6))]
    ids, w, _ = collate(ragged, 3.0)
    keep = w > 0
    assert not keep.all()
    for vocab in (None, torch.arange(3, 128, 2)):
        torch.manual_seed(0)
        head = MTPHead.from_target(loaded.target)
        with torch.no_grad():
            hidden = loaded.target.forward_full(ids)
        grads = []
        for k in (None, keep):
            head.zero_grad()
            teacher = loaded.target.logits(hidden if k is None else hidden[k])
            loss, _ = mtp_loss([head], hidden, teacher, ids, w, 3, 0.6, 0.5, vocab, k)
            loss.backward()
            grads.append((loss.detach(), [p.grad.clone() for p in head.parameters() if p.grad is not None]))
        torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-6)
        for a, b in zip(grads[0][1], grads[1][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_length_grouped_batches_cover_every_sequence_and_cut_padding():
    import random

    from pipeline.training.train_mtp import length_grouped_batches
    rng = random.Random(1)
    lengths = [rng.choice([30, 40, 80, 200, 350]) + rng.randrange(10) for _ in range(640)]
    grouped = length_grouped_batches(lengths, 16, 80, seed=0, group=8)       # two epochs
    plain = length_grouped_batches(lengths, 16, 80, seed=0, group=1)
    assert grouped == length_grouped_batches(lengths, 16, 80, seed=0, group=8)  # resumable: seeded
    for batches in (grouped, plain):
        assert all(len(b) == 16 for b in batches)
        assert sorted(i for b in batches[:40] for i in b) == list(range(640))  # each once an epoch
        assert sorted(i for b in batches[40:] for i in b) == list(range(640))

    def real(batches):
        return sum(sum(lengths[i] for i in b) for b in batches) / sum(16 * max(lengths[i] for i in b) for b in batches)
    assert real(grouped) > 0.85 and real(plain) < 0.6           # these lengths: 0.89 against 0.43


def test_greedy_sequences_in_length_batches_keep_prompt_order(tmp_path):
    """Training continuations are generated in batches of similar length; each comes back at
    its prompt's place and equals that prompt generated alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.training.train_mtp import greedy_sequences
    path = make_tiny_checkpoint(tmp_path / "ckpt", num_mtp_layers=0, seed=1)
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = ["def add(a, b): return a + b " * k for k in (3, 1, 5, 2, 1, 4)]
    batched = greedy_sequences(hf, tok, prompts, 128, 6, batch_size=3)
    alone = [greedy_sequences(hf, tok, [p], 128, 6, batch_size=1)[0] for p in prompts]
    assert [p for _, p in batched] == [len(tok(p)["input_ids"]) for p in prompts]
    for (a, pa_), (b, pb) in zip(batched, alone):
        assert pa_ == pb and torch.equal(a, b)
