"""Coupled verification's pieces: keyed exponential noise, Gumbel-max sampling, coupled_accept."""
import torch

from pipeline.spec_decode import rng
from pipeline.spec_decode.acceptance import coupled_accept
from pipeline.spec_decode.sampling import coupled_sample, filtered_probs, sparse_coupled_sample
from tests.stats_util import chi_square_pvalue


def test_noise_is_the_splitmix64_sequence_of_its_position():
    keys, pos = torch.tensor([3, -7]), torch.tensor([[0, 5], [9, 2**40]])
    noise = rng.exponential_noise(11, keys, pos, 50)                               # [2, 2, 50]
    base = rng.counter_hash(11, keys, pos, rng.NOISE)                               # [2, 2]
    for i in range(2):
        for j in range(2):
            x = rng.splitmix64(base[i, j] + torch.arange(50) * rng._GOLDEN)         # outputs 0..49
            u = (rng._shr(x, 41).to(torch.float32) + 0.5) / 2**23
            assert torch.equal(noise[i, j], -torch.log(u))


def test_noise_depends_on_seed_key_and_position_only():
    keys = torch.tensor([10, 11, 12, 13])
    pos = torch.tensor([[4, 5, 6], [4, 5, 6], [0, 1, 2], [7, 8, 9]])
    full = rng.exponential_noise(5, keys, pos, 97)
    # any subset of rows and positions, in any order and shape, gets the same values
    assert torch.equal(rng.exponential_noise(5, keys[[2, 0]], pos[[2, 0], 1], 97), full[[2, 0], 1])
    assert torch.equal(rng.exponential_noise(5, keys[3:], pos[3:, 2:], 97)[0, 0], full[3, 2])
    assert not torch.equal(full[0], full[1])                        # other key, same positions
    assert not torch.equal(full[0, 0], full[0, 1])                  # same key, next position
    assert not torch.equal(rng.exponential_noise(6, keys, pos, 97), full)
    assert torch.equal(rng.exponential_noise(5, keys, pos, 40), full[..., :40])   # token v: output v


def test_noise_of_chosen_tokens_equals_the_full_noise_there():
    keys, pos = torch.tensor([1, 2]), torch.tensor([[3, 4], [5, 6]])
    ids = torch.tensor([[[7, 0, 99], [5, 5, 1]], [[98, 2, 3], [0, 1, 2]]])                # [2, 2, 3]
    full = rng.exponential_noise(9, keys, pos, 100)
    assert torch.equal(rng.exponential_noise(9, keys, pos, 100, tokens=ids), full.gather(-1, ids))


def test_sparse_coupled_sample_picks_what_the_full_noise_picks():
    n, vocab = 64, 500
    keys, pos = torch.arange(n), torch.arange(3) + torch.randint(0, 100, (n, 1))            # [n, 3]
    logits = torch.randn(n, 3, vocab) * 2
    full = rng.exponential_noise(4, keys, pos, vocab)
    for kw in (dict(top_k=40), dict(top_p=0.3), dict(top_k=100, top_p=0.8)):
        probs = filtered_probs(logits, 0.8, **kw)
        tokens = sparse_coupled_sample(probs, 4, keys, pos)
        assert tokens is not None and torch.equal(tokens, coupled_sample(probs, full)), kw
    assert sparse_coupled_sample(filtered_probs(logits, 0.8), 4, keys, pos) is None   # nothing filtered


def test_noise_is_exponential():
    noise = rng.exponential_noise(0, torch.arange(64), torch.arange(8).expand(64, 8), 1000).flatten()
    assert torch.all(noise > 0) and torch.all(torch.isfinite(noise))
    u = torch.exp(-noise)                                            # back to uniforms: 20 equal bins
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert chi_square_pvalue(counts, torch.full((20,), 1 / 20)) > 1e-4
    assert abs(float(noise.mean()) - 1) < 0.01 and abs(float(noise.var()) - 1) < 0.02


def test_coupled_sample_example_and_distribution():
    assert coupled_sample(torch.tensor([0.5, 0.3, 0.2]), torch.tensor([2.0, 0.5, 1.0])).item() == 1
    logits = torch.tensor([0.0, 1.0, -1.0, 2.0, 0.5, -3.0, 1.5, 0.2])
    for probs in (filtered_probs(logits, 0.7), filtered_probs(logits, 1.0, top_k=4),
                  filtered_probs(logits, 1.0, top_p=0.8)):
        n = 40000
        noise = rng.exponential_noise(1, torch.arange(n), torch.full((n,), 17), 8)    # [n, 8]
        counts = torch.bincount(coupled_sample(probs.expand(n, 8), noise), minlength=8)
        assert torch.all(counts[probs == 0] == 0)
        assert chi_square_pvalue(counts, probs) > 1e-4


def test_same_noise_couples_draft_and_target():
    """A drafter with the target's distribution is always accepted; a close one mostly: the
    Gumbel-max coupling matches with probability at least (1 - tv) / (1 + tv) (tv: total
    variation distance), and no coupling exceeds 1 - tv."""
    n = 20000
    noise = rng.exponential_noise(2, torch.arange(n), torch.zeros(n, dtype=torch.long), 16)
    p = torch.softmax(torch.linspace(-2, 2, 16), -1).expand(n, 16)
    q = torch.softmax(torch.linspace(-2, 2, 16) + 0.3 * torch.cos(torch.arange(16.0)), -1).expand(n, 16)
    target = coupled_sample(p, noise)
    assert torch.equal(coupled_sample(p.clone(), noise), target)
    match = float((coupled_sample(q, noise) == target).double().mean())
    tv = 0.5 * float((p[0] - q[0]).abs().sum())
    independent = float((p[0] * q[0]).sum())                  # P(match) with independent noise
    assert independent < 0.2 < (1 - tv) / (1 + tv) < match <= 1 - tv + 0.01, (match, tv, independent)


def test_coupled_accept_examples():
    drafts, target = torch.tensor([[5, 7], [5, -1]]), torch.tensor([[5, 9, 4], [5, 6, 2]])
    num, emitted = coupled_accept(drafts, target)
    assert num.tolist() == [1, 1] and torch.equal(emitted, target)
    # ragged rows: padded drafts (-1) never match, so a row stops at its own draft count
    drafts = torch.tensor([[3, 4, 5], [3, 4, -1], [-1, -1, -1], [3, 8, 5]])
    num, _ = coupled_accept(drafts, torch.tensor([[3, 4, 5, 6]] * 4))
    assert num.tolist() == [3, 2, 0, 1]
    num, emitted = coupled_accept(torch.zeros(2, 0, dtype=torch.long), torch.tensor([[4], [6]]))
    assert num.tolist() == [0, 0] and emitted[:, 0].tolist() == [4, 6]


def test_coupled_sampler_hashes_each_position_once(monkeypatch):
    """A verify step's target pick reuses the noise its drafts drew (gamma + 1 positions hashed,
    not 2 gamma + 1), and picks what fresh noise would."""
    from pipeline.engine.coupled import CoupledSampler

    drawn = []
    real = rng.exponential_noise

    def counting(seed, keys, positions, vocab, tokens=None):
        drawn.append(positions.numel())
        return real(seed, keys, positions, vocab, tokens)

    monkeypatch.setattr(rng, "exponential_noise", counting)
    n, vocab, gamma = 5, 64, 2
    keys, lengths = torch.arange(n) * 3, torch.tensor([4, 9, 2, 7, 7])
    probs = torch.softmax(torch.randn(n, gamma + 1, vocab), -1)
    sampler = CoupledSampler(seed=1)
    drafts = torch.stack([sampler.draft(probs[:, d - 1], keys, lengths + d) for d in range(1, gamma + 1)], 1)
    out_pos = lengths[:, None] + 1 + torch.arange(gamma + 1)                     # [n, gamma + 1]
    target = sampler.target(probs, keys, out_pos)
    assert drawn == [n, n, n]                                                    # depth 1, depth 2, the bonus column
    assert torch.equal(target, coupled_sample(probs, real(1, keys, out_pos, vocab)))
    assert torch.equal(drafts, target[:, :gamma])                               # same distributions: all kept
