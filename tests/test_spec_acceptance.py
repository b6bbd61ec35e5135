"""The pure speculative-decoding math: acceptance rule, sampling, random streams, stats."""
import math

import torch

from pipeline.spec_decode import rng
from pipeline.spec_decode.acceptance import accepted_prefix, greedy_accept, rejection_sample
from pipeline.spec_decode.sampling import argmax_last, filtered_probs, sample
from pipeline.spec_decode.stats import SpecStats
from tests.stats_util import chi_square_pvalue


def one_hot_logits(tokens, vocab):
    """Greedy cases built from +100/-100 logits."""
    logits = torch.full((*tokens.shape, vocab), -100.0)
    return logits.scatter(-1, tokens[..., None], 100.0)


def test_accepted_prefix():
    accept = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert accepted_prefix(accept).tolist() == [2, 0, 4]


def test_greedy_accept_ragged_rows():
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7]])
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    num, emitted = greedy_accept(drafts, one_hot_logits(target, 10))
    assert num.tolist() == [3, 1, 0]
    assert [emitted[i, :n + 1].tolist() for i, n in enumerate(num.tolist())] == [[5, 6, 7, 8], [5, 6], [5]]


def test_greedy_accept_gamma_zero():
    num, emitted = greedy_accept(torch.zeros(2, 0, dtype=torch.long), one_hot_logits(torch.tensor([[3], [4]]), 6))
    assert num.tolist() == [0, 0] and emitted[:, 0].tolist() == [3, 4]


def test_argmax_last_is_torch_argmax_with_ties_and_a_short_last_block(monkeypatch):
    """The two-pass argmax returns torch.argmax's index (the first largest) in every block
    layout: ties within a block, across blocks, in the short last block, and at its last value."""
    import pipeline.spec_decode.sampling as sampling
    monkeypatch.setattr(sampling, "BLOCKED_ARGMAX_MIN", 0)
    monkeypatch.setattr(sampling, "ARGMAX_BLOCK", 4)
    assert argmax_last(torch.tensor([[1.0, 5, 5, 2, 0, 5, 1, 1, 1]])).tolist() == [1]
    gen = torch.Generator().manual_seed(0)
    for v in (8, 9, 11, 23):
        x = torch.randint(0, 4, (3, 5, v), generator=gen).float()       # many ties
        assert torch.equal(argmax_last(x), x.argmax(-1)), v
        x[..., -1] = 9.0                                                 # the largest at the very end
        assert torch.equal(argmax_last(x), x.argmax(-1)), v
    blocked = []
    monkeypatch.setattr(sampling, "BLOCKED_ARGMAX_MIN", 100)             # small inputs: torch.argmax itself
    monkeypatch.setattr(torch.Tensor, "amax", lambda self, *a, **k: blocked.append(1) or torch.amax(self, *a, **k))
    x = torch.randn(2, 40)
    assert torch.equal(argmax_last(x), x.argmax(-1)) and not blocked
    x = torch.randn(3, 40)
    assert torch.equal(argmax_last(x), x.argmax(-1)) and blocked


def test_filtered_probs_examples():
    logits = torch.tensor([0.0, 0.0, math.log(2.0)])
    assert torch.allclose(filtered_probs(logits, 1.0), torch.tensor([0.25, 0.25, 0.5]))
    assert torch.allclose(filtered_probs(logits, 1.0, top_k=1), torch.tensor([0.0, 0.0, 1.0]))
    # top_p keeps the smallest prefix (by probability) whose mass reaches p: 0.5 then 0.25
    top_p = filtered_probs(logits, 1.0, top_p=0.6)
    assert top_p[2] > 0 and (top_p > 0).sum() == 2 and torch.isclose(top_p.sum(), torch.tensor(1.0))
    assert torch.allclose(filtered_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))


def test_sample_follows_probabilities_and_skips_zeros():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3])
    u = rng.uniforms(1, torch.zeros(1, dtype=torch.long), torch.arange(20000)[None], rng.TARGET)[0]
    tokens = sample(probs.expand(20000, 5), u)
    counts = torch.bincount(tokens, minlength=5)
    assert counts[0] == 0 and counts[2] == 0
    assert chi_square_pvalue(counts, probs) > 1e-3


def test_uniforms_are_keyed_and_reproducible():
    rows, pos = torch.arange(3), torch.arange(8).expand(3, 8)
    a = rng.uniforms(7, rows, pos, rng.DRAFT)
    assert torch.equal(a, rng.uniforms(7, rows, pos, rng.DRAFT))
    assert not torch.equal(a, rng.uniforms(8, rows, pos, rng.DRAFT))
    assert not torch.equal(a, rng.uniforms(7, rows, pos, rng.ACCEPT))
    assert torch.equal(a[1], rng.uniforms(7, rows[1:2], pos[1:2], rng.DRAFT)[0])   # batch-independent
    assert a.min() >= 0 and a.max() < 1


def test_rejection_sampling_reproduces_target_distribution():
    """Many independent trials of one step with gamma 3: the first emitted token follows p_1
    exactly, and given the first draft accepted the second follows p_2 (lossless rule)."""
    torch.manual_seed(0)
    vocab, gamma, n = 6, 3, 60000
    p = torch.softmax(torch.randn(gamma + 1, vocab) * 1.5, -1)        # target, per position
    q = torch.softmax(torch.randn(gamma, vocab) * 1.5, -1)            # draft, per depth
    keys = torch.arange(n)
    u_draft = rng.uniforms(3, keys, torch.arange(gamma).expand(n, gamma), rng.DRAFT)
    drafts = sample(q.expand(n, gamma, vocab), u_draft)
    u_acc = rng.uniforms(3, keys, torch.arange(gamma).expand(n, gamma), rng.ACCEPT)
    u_fin = rng.uniforms(3, keys, torch.arange(gamma + 1).expand(n, gamma + 1), rng.TARGET)
    num, emitted = rejection_sample(drafts, q.expand(n, gamma, vocab), p.expand(n, gamma + 1, vocab), u_acc, u_fin)
    first = torch.bincount(emitted[:, 0], minlength=vocab)
    assert chi_square_pvalue(first, p[0]) > 1e-3
    # Position 2 is emitted whenever draft 1 was accepted; its law is p_2 (contexts are fixed here).
    second = torch.bincount(emitted[num >= 1, 1], minlength=vocab)
    assert chi_square_pvalue(second, p[1]) > 1e-3
    # Acceptance of draft 1 happens with probability sum_x min(p, q).
    expected_rate = torch.minimum(p[0], q[0]).sum().item()
    assert abs((num >= 1).double().mean().item() - expected_rate) < 0.01


def test_rejection_sampling_accepts_everything_when_draft_equals_target():
    vocab, gamma, n = 5, 2, 2000
    p = torch.softmax(torch.randn(gamma + 1, vocab), -1)
    keys = torch.arange(n)
    drafts = sample(p[:gamma].expand(n, gamma, vocab), rng.uniforms(0, keys, torch.arange(gamma).expand(n, gamma), rng.DRAFT))
    num, _ = rejection_sample(drafts, p[:gamma].expand(n, gamma, vocab), p.expand(n, gamma + 1, vocab),
                              rng.uniforms(0, keys, torch.zeros(n, gamma, dtype=torch.long), rng.ACCEPT),
                              rng.uniforms(0, keys, torch.zeros(n, gamma + 1, dtype=torch.long), rng.TARGET))
    assert torch.all(num == gamma)


def test_stats_per_depth_acceptance_and_merge():
    a, b = SpecStats(), SpecStats()
    a.observe_acceptance(3, torch.tensor([0, 1, 3, 2]))
    b.observe_acceptance(1, torch.tensor([1, 1]))
    assert a.reached == [4, 3, 2] and a.accepted == [3, 2, 1]
    assert a.mean_acceptance_length() == 2.5
    m = a.merge(b)
    assert m.reached == [6, 3, 2] and m.accepted == [5, 2, 1]
    assert m.acceptance_by_depth()[0] == 5 / 6
    assert m.mean_acceptance_length() == (6 + 4 + 2 + 2) / 6
    c = SpecStats()                                      # the engine passes a list of ints
    c.observe_acceptance(3, [0, 1, 3, 2])
    assert (c.reached, c.accepted, c.row_steps, c.emitted_tokens) == (a.reached, a.accepted, a.row_steps, a.emitted_tokens)
