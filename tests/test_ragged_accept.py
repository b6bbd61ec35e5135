"""Acceptance with per-row draft counts and deterministic (one-hot q) drafts: exact sampling."""
import torch

from pipeline.spec_decode.acceptance import greedy_accept
from pipeline.spec_decode.acceptance import PAD, rejection_sample_ragged
from pipeline.spec_decode.row_drafts import cumulative, draft_lengths, padded_lengths, rows_p
from pipeline.spec_decode.stats import SpecStats, add_ragged_counts
from tests.stats_util import chi_square_pvalue

V = 5
P1 = torch.tensor([0.1, 0.2, 0.4, 0.2, 0.1])       # the target's p at a row's first and second positions
P2 = torch.tensor([0.3, 0.3, 0.1, 0.2, 0.1])


def _draws(n, g, gen):
    return torch.rand(n, g, generator=gen), torch.rand(n, g + 1, generator=gen)


def test_padded_slots_never_match_greedy():
    drafts = torch.tensor([[3, PAD, PAD], [3, 4, PAD]])
    logits = torch.full((2, 4, 6), -100.0)
    logits[:, :, 0] = 100.0
    logits[:, 0, 0], logits[:, 0, 3] = -100.0, 100.0      # position 0 says 3, then 0
    num, _ = greedy_accept(drafts, logits)
    assert num.tolist() == [1, 1]


def test_one_hot_rows_sample_the_target_exactly():
    """q one-hot at d: accept with p(d), else p with d removed; the emitted tokens follow p."""
    gen = torch.Generator().manual_seed(0)
    n = 40000
    p1, p2 = P1, P2
    p3 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    target = torch.stack([p1, p2, p3])[None].expand(n, 3, V)
    drafts = torch.tensor([[2, 4]]).expand(n, 2)
    u_acc, u_fin = _draws(n, 2, gen)
    num, emitted = rejection_sample_ragged(drafts, None, target, u_acc, u_fin, torch.full((n,), 2))
    first = emitted[:, 0]
    assert chi_square_pvalue(torch.bincount(first, minlength=V), p1) > 1e-3
    kept = num >= 1                                        # the first token was the draft 2 ...
    second = emitted[kept, 1]                              # ... then position 2 follows p2
    assert chi_square_pvalue(torch.bincount(second, minlength=V), p2) > 1e-3
    assert abs(float(kept.float().mean()) - 0.4) < 0.01


def test_mixed_rows_and_counts_sample_the_target_exactly():
    """Rows with a real q, rows one-hot, rows with 0 drafts in one call: each follows p."""
    gen = torch.Generator().manual_seed(1)
    n = 30000
    p = torch.tensor([0.05, 0.25, 0.3, 0.3, 0.1])
    q = torch.tensor([0.4, 0.1, 0.1, 0.2, 0.2])
    kind = torch.arange(n) % 3                             # 0: q row, 1: one-hot row, 2: no drafts
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)[:, None]
    drafts = torch.where(kind[:, None] == 1, torch.full_like(drafts, 3), drafts)
    draft_len = (kind != 2).long()
    drafts = torch.where(draft_len[:, None] > 0, drafts, PAD)
    probs = torch.where((kind == 0)[:, None, None], q.expand(n, 1, V), torch.zeros(n, 1, V))
    target = p.expand(n, 2, V)
    u_acc, u_fin = _draws(n, 1, gen)
    num, emitted = rejection_sample_ragged(drafts, probs, target, u_acc, u_fin, draft_len, kind == 1)
    assert (num[kind == 2] == 0).all() and (num <= draft_len).all()
    for k in range(3):
        first = emitted[kind == k, 0]
        assert chi_square_pvalue(torch.bincount(first, minlength=V), p) > 1e-3, k


def test_draft_lengths_worked_example():
    p = [[0.9, 0.8], [0.2, 0.0]]
    assert draft_lengths(p, base_s=10.0, token_s=1.0) == [2, 0]
    assert draft_lengths(p, base_s=10.0, token_s=0.01) == [2, 1]    # drafts nearly free
    assert draft_lengths(p, base_s=10.0, token_s=9.0) == [0, 0]     # compute-bound: none pay
    assert rows_p(cumulative([0.5, 0.5, 0.5]), 2) == [0.5, 0.25, 0.0]
    assert padded_lengths([[0.9, 0.8], [0.2, 0.0]], [10.0, 12.0, 14.0]) == [2, 1]   # its docstring's example
    assert padded_lengths([[0.9, 0.8], [0.2, 0.0]], [10.0, 28.0, 46.0]) == [0, 0]


def test_ragged_counts_per_source():
    reached, accepted = [], []
    add_ragged_counts(reached, accepted, [3, 1], [1, 1])
    assert (reached, accepted) == ([2, 1, 0], [2, 0, 0])
    s = SpecStats()
    s.observe_source("ngram", [3, 2], [3, 0], "ngram:3")
    s.observe_source("mtp", [2], [1])
    merged = s.merge(s.counts())
    assert merged.drafted_by_source == {"ngram": 10, "mtp": 4}
    assert merged.accepted_by_source == {"ngram": 6, "mtp": 2}
    assert merged.source_reached["ngram:3"] == [4, 2, 2]


def test_acceptance_over_all_sources_pools_them_and_keeps_the_heads_apart():
    s = SpecStats()
    s.observe_source("ngram", [3, 1], [1, 1], "ngram:3")
    s.observe_source("mtp", [2], [2])
    s.observe_ragged([3, 1, 2], [1, 1, 2], depth_rows=[2])       # row 2 drafted with the heads
    assert s.acceptance_by_depth_all_sources()[:2] == [1.0, 0.5]
    assert s.acceptance_by_depth() == [1.0, 1.0]                  # the heads' evidence alone
    assert s.row_steps == 3 and s.emitted_tokens == 4 + 3


def test_a_heads_draft_then_a_one_hot_tail_in_one_row_samples_the_target_exactly():
    """A heads row's n-gram tail: draft 1 sampled from q (its q counts), draft 2 a fixed token
    (q one-hot, marked per draft). Both positions follow p, and the tail's token is kept with
    p2(d) once the first draft was."""
    gen = torch.Generator().manual_seed(2)
    n = 40000
    p1, p2 = P1, P2
    q = torch.tensor([0.4, 0.1, 0.1, 0.2, 0.2])
    target = torch.stack([p1, p2, p2])[None].expand(n, 3, V)
    first = torch.multinomial(q, n, replacement=True, generator=gen)
    drafts = torch.stack([first, torch.full_like(first, 1)], dim=1)            # tail token 1
    probs = torch.stack([q, torch.zeros(V)])[None].expand(n, 2, V)
    one_hot = torch.tensor([[False, True]]).expand(n, 2)
    u_acc, u_fin = _draws(n, 2, gen)
    num, emitted = rejection_sample_ragged(drafts, probs, target, u_acc, u_fin, torch.full((n,), 2), one_hot)
    assert chi_square_pvalue(torch.bincount(emitted[:, 0], minlength=V), p1) > 1e-3
    kept = num >= 1
    assert chi_square_pvalue(torch.bincount(emitted[kept, 1], minlength=V), p2) > 1e-3
    assert abs(float((num[kept] == 2).float().mean()) - 0.3) < 0.015


def test_tail_lengths_worked_example():
    from pipeline.spec_decode.row_drafts import tail_lengths
    costs = [0.8, 0.9, 1.0, 1.05, 1.1, 1.4]
    assert tail_lengths([[0.5, 0.4, 0.1]], 2, 2, 3.0, costs) == [2]          # its docstring's example
    assert tail_lengths([[0.5, 0.4, 0.1], []], 2, 2, 3.0, [0.8, 0.9, 1.0, 1.5, 2.0, 2.5]) == [0, 0]
    assert tail_lengths([[0.5, 0.4, 0.1], []], 3, 2, 3.0, [0.8, 0.9, 1.0, 1.5, 2.0, 2.5]) == [1, 0]   # within the width: free
