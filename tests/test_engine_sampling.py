"""Invariant 2 end to end: speculative sampling through the engine reproduces the target's
distribution under both verification rules (small vocabulary, many samples), and a seed
reproduces outputs."""
import itertools

import pytest
import torch
import transformers

from pipeline.engine import Engine, SamplingParams
from tests.stats_util import chi_square_pvalue, two_sample_pvalue
from tests.tiny_models import heads_always_at, keep_every_tail, tiny_checkpoint

VOCAB, NEW, N = 8, 4, 30000
PROMPT = [3, 5, 1, 6]
TEMPERATURE, TOP_K = 0.9, 6


def _exact_joint(path) -> torch.Tensor:
    """P(t1..t4 | PROMPT) from transformers, with temperature and top-k applied by hand."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    seqs = torch.tensor([PROMPT + list(c) for c in itertools.product(range(VOCAB), repeat=NEW - 1)])
    with torch.no_grad():
        logits = model(seqs).logits[:, len(PROMPT) - 1:].double() / TEMPERATURE   # [V^3, NEW, V]
    kth = logits.topk(TOP_K, dim=-1).values[..., -1:]
    probs = torch.softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
    joint = torch.ones(VOCAB ** (NEW - 1), dtype=torch.float64)
    for j in range(NEW - 1):
        joint = joint * probs[torch.arange(len(seqs)), j, seqs[:, len(PROMPT) + j]]
    # joint over (t1, t2, t3) for each row of seqs, times P(t4 | t1..t3)
    full = joint[:, None] * probs[:, NEW - 1]                                       # [V^3, V]
    return full.reshape(*(VOCAB,) * NEW)


def _counts(toks) -> torch.Tensor:
    flat = sum(toks[:, j] * VOCAB ** (NEW - 1 - j) for j in range(NEW))
    return torch.bincount(flat, minlength=VOCAB ** NEW).reshape(*(VOCAB,) * NEW)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt")), arch="llama", vocab_size=VOCAB,
                           num_mtp_layers=1, hidden_size=32, initializer_range=0.15, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=2048)
    runs = {}
    for verify, gamma, draft in (("coupled", 0, "none"), ("coupled", 3, "mtp"), ("rejection", 3, "mtp"),
                                 ("coupled", 3, "ngram"), ("rejection", 3, "ngram"),
                                 ("coupled", "tails", "auto"), ("rejection", "tails", "auto")):
        params = SamplingParams(max_new_tokens=NEW, temperature=TEMPERATURE, top_k=TOP_K, seed=11,
                                ignore_eos=True, verify=verify)
        before = dict(engine.stats.drafted_by_source)
        with pytest.MonkeyPatch.context() as mp:
            if gamma == "tails":     # one head's draft (with its q), then a one-hot n-gram tail
                kept = keep_every_tail(mp)
                outs = engine.generate([PROMPT] * N, params, gamma=heads_always_at(engine, 1), draft=draft)
                assert any(any(step) for step in kept)
            else:
                outs = engine.generate([PROMPT] * N, params, gamma=gamma, draft=draft)
        tokens = torch.tensor([o.token_ids for o in outs])
        key = (verify, gamma) if draft != "ngram" else (verify, "ngram")
        runs[key] = (tokens, _counts(tokens))                          # [N, NEW], [V] * NEW
        if draft in ("ngram", "auto"):     # one-hot drafts from the rows' own tokens and the task's outputs
            assert engine.stats.drafted_by_source.get("ngram", 0) > before.get("ngram", 0)
    return path, engine, runs


def test_speculative_sampling_matches_exact_target_distribution(setup):
    path, engine, runs = setup
    exact = _exact_joint(path)
    for run, (_, counts) in runs.items():
        assert counts.sum() == N
        # the joint of all 4 tokens (rare outcomes pooled), marginals of each position, and
        # pairs of neighbours, against the exact probabilities
        assert chi_square_pvalue(counts, exact) > 1e-4, run
        for j in range(NEW):
            dims = tuple(d for d in range(NEW) if d != j)
            assert chi_square_pvalue(counts.sum(dims), exact.sum(dims)) > 1e-4, (run, j)
        for j in range(NEW - 1):
            dims = tuple(d for d in range(NEW) if d not in (j, j + 1))
            assert chi_square_pvalue(counts.sum(dims), exact.sum(dims)) > 1e-4, (run, j)


def test_gamma_three_against_gamma_zero(setup):
    _, engine, runs = setup
    for run in (("coupled", 3), ("rejection", 3), ("rejection", "ngram"), ("rejection", "tails")):
        for j in range(NEW):
            dims = tuple(d for d in range(NEW) if d != j)
            assert two_sample_pvalue(runs[run][1].sum(dims), runs["coupled", 0][1].sum(dims)) > 1e-4, (run, j)


def test_coupled_rows_equal_plain_sampling_with_their_noise(setup):
    """Coupled at gamma 3 emits, row for row, what gamma 0 emits: the same 30,000 samples."""
    _, _, runs = setup
    assert torch.equal(runs["coupled", 3][0], runs["coupled", 0][0])
    assert torch.equal(runs["coupled", "ngram"][0], runs["coupled", 0][0])
    assert torch.equal(runs["coupled", "tails"][0], runs["coupled", 0][0])
    assert not torch.equal(runs["rejection", 3][0], runs["coupled", 0][0])


def test_drafts_were_verified_and_partly_rejected(setup):
    _, engine, _ = setup
    acc = engine.stats.acceptance_by_depth()
    assert len(acc) == 3 and 0.05 < acc[0] < 0.95, acc


def test_seed_reproduces_outputs_independently_of_batching(setup):
    path, _, _ = setup
    prompts = [PROMPT, PROMPT[:2], [1, 2, 3, 4, 5, 6, 7]] * 4
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    wide = Engine.from_pretrained(path, device="cpu", max_batch_size=16)
    narrow = Engine.from_pretrained(path, device="cpu", max_batch_size=3)
    a = [o.token_ids for o in wide.generate(prompts, params, gamma=3)]
    b = [o.token_ids for o in wide.generate(prompts, params, gamma=3)]
    c = [o.token_ids for o in narrow.generate(prompts, params, gamma=3)]
    d = [o.token_ids for o in wide.generate(prompts, SamplingParams(**{**params.__dict__, "seed": 6}), gamma=3)]
    assert a == b == c
    assert a != d
    # a row's tokens follow its key, not its position in the call
    keys = list(range(len(prompts)))[::-1]
    e = [o.token_ids for o in wide.generate(prompts[::-1], params, gamma=3, row_keys=keys)]
    assert e[::-1] == a
