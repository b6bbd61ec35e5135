"""Invariant 2 under coupled verification: one seed gives one text per row at every gamma (auto
and a gamma that changes every step included), batch size, max_batch_size and retry on a fresh
engine; another seed gives another text. Distribution checks are in test_engine_sampling.py."""
import dataclasses

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.engine import Engine, SamplingParams
from pipeline.spec_decode.policy import FixedGamma
from tests.tiny_models import random_prompts, tiny_checkpoint

LENGTHS = [5, 9, 3, 12, 7, 1, 15, 4, 8, 2, 6, 11]
VARIANTS = [dict(temperature=0.8), dict(temperature=0.8, top_k=20), dict(temperature=0.8, top_p=0.9),
            dict(temperature=1.0, top_k=30, top_p=0.8)]


class CyclingGamma(FixedGamma):
    """A gamma that changes every step (as auto's does with measured costs): 0, 3, 1, 5, 2, 4, ..."""

    def __init__(self):
        super().__init__(5, "cycling")
        object.__setattr__(self, "steps", [])

    def choose(self, ctx) -> int:
        self.steps.append((0, 3, 1, 5, 2, 4)[len(self.steps) % 6])
        return self.steps[-1]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt")), arch="llama", num_mtp_layers=2,
                           draftable=0.05, with_tokenizer=False)


def _params(seed=3, verify="coupled", **kw):
    return SamplingParams(max_new_tokens=24, seed=seed, verify=verify, ignore_eos=True, **kw)


def _tokens(engine, prompts, params, gamma, row_keys=None):
    return [o.token_ids for o in engine.generate(prompts, params, gamma=gamma, row_keys=row_keys)]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}{v[k]}" for k in v))
def test_coupled_text_is_the_same_at_every_gamma(path, variant):
    prompts = random_prompts(LENGTHS, 128, seed=1)
    params = _params(**variant)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=48)
    ref = _tokens(engine, prompts, params, 0)
    for gamma in range(1, 6):
        engine.reset_stats()
        assert _tokens(engine, prompts, params, gamma) == ref, f"gamma={gamma}"
        acc = engine.stats.acceptance_by_depth()[0]
        assert 0 < acc < 1, f"drafts must be partly rejected to test anything: a_1={acc}"
    cycling = CyclingGamma()
    assert _tokens(engine, prompts, params, cycling) == ref
    assert len(set(cycling.steps)) == 6
    fresh = Engine.from_pretrained(path, device="cpu", max_batch_size=48)     # auto calibrates, then decides
    assert _tokens(fresh, prompts, params, "auto") == ref
    assert any(s.gamma > 0 for s in fresh.last_stats.steps)


def test_rejection_rule_does_not_have_this_property(path):
    """The control: the test above would catch a sampler whose text follows gamma."""
    prompts = random_prompts(LENGTHS, 128, seed=1)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=48)
    params = _params(verify="rejection", temperature=0.8)
    assert _tokens(engine, prompts, params, 0) != _tokens(engine, prompts, params, 3)


def test_coupled_text_is_the_same_at_every_batch_size(path):
    prompts = random_prompts([(3 * i) % 17 + 1 for i in range(48)], 128, seed=2)
    params = _params(temperature=0.8, top_p=0.95)
    ref = _tokens(Engine.from_pretrained(path, device="cpu", max_batch_size=48), prompts, params, 3)
    for max_batch_size, gamma in ((1, 3), (8, 2), (8, "auto"), (5, CyclingGamma()), (48, "auto")):
        engine = Engine.from_pretrained(path, device="cpu", max_batch_size=max_batch_size)
        assert _tokens(engine, prompts, params, gamma) == ref, (max_batch_size, gamma)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=48)
    # a call of 8 rows, and one row alone, keyed as in the call of 48
    assert _tokens(engine, prompts[8:16], params, 1, row_keys=range(8, 16)) == ref[8:16]
    assert _tokens(engine, [prompts[29]], params, 4, row_keys=[29]) == [ref[29]]
    # and in reverse order: a row's text follows its key, not its slot
    assert _tokens(engine, prompts[::-1], params, 3, row_keys=range(47, -1, -1))[::-1] == ref


def test_different_seeds_give_different_text(path):
    prompts = random_prompts(LENGTHS, 128, seed=1)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=48)
    a = _tokens(engine, prompts, _params(seed=3, temperature=0.8), 3)
    b = _tokens(engine, prompts, _params(seed=4, temperature=0.8), 3)
    assert a == _tokens(engine, prompts, _params(seed=3, temperature=0.8), 2)
    assert sum(x != y for x, y in zip(a, b)) >= len(prompts) - 1


def test_greedy_ignores_the_verify_rule(path):
    prompts = random_prompts(LENGTHS, 128, seed=1)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=48)
    greedy = [_tokens(engine, prompts, _params(verify=v, temperature=0.0), g)
              for v in ("coupled", "rejection") for g in (0, 3)]
    assert all(g == greedy[0] for g in greedy)


def test_retried_shard_on_a_fresh_actor_gives_the_same_text(tmp_path):
    """process_shard (the actor's work) twice: attempt 1 on one engine with auto, attempt 2 on a
    fresh engine with other slots, another gamma and another shard layout."""
    from pipeline.cluster.worker import ShardTask, process_shard
    from pipeline.config import DataConfig
    from pipeline.data import open_source, plan_shards

    ckpt = tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_mtp_layers=1, draftable=0.05)
    words = "the quick brown fox jumps over lazy dog".split()
    rows = {"uid": [f"r{i}" for i in range(24)],
            "text": [" ".join(words[(i + j) % len(words)] for j in range(i % 5 + 2)) for i in range(24)]}
    pq.write_table(pa.table(rows), tmp_path / "d.parquet")
    source = open_source(str(tmp_path / "d.parquet"))
    data = DataConfig(path=str(tmp_path / "d.parquet"), prompt_column="text", id_column="uid")
    sampling = SamplingParams(max_new_tokens=20, temperature=0.9, top_k=40, seed=7)

    def run(engine, rows_per_shard, gamma, attempt, sampling=sampling):
        texts = {}
        for shard in plan_shards(source, rows_per_shard):
            task = ShardTask(shard, attempt, source.files, source.file_rows, data, (), sampling, gamma)
            table = process_shard(engine, task, {"device": "cpu"}).table
            texts |= dict(zip(table["id"].to_pylist(), table["generated_text"].to_pylist()))
        return texts

    first = run(Engine.from_pretrained(ckpt, device="cpu", max_batch_size=8), 24, "auto", 1)
    retry = run(Engine.from_pretrained(ckpt, device="cpu", max_batch_size=3), 10, 4, 2)
    assert len(first) == 24 and first == retry
    assert len(set(first.values())) > 12
    other = run(Engine.from_pretrained(ckpt, device="cpu", max_batch_size=8), 24, 2, 1,
                dataclasses.replace(sampling, seed=8))
    assert sum(other[k] != first[k] for k in first) > 12


def test_coupled_text_is_the_same_for_every_draft_source(path):
    """The n-gram source proposes from the row's own tokens and the task's earlier outputs; under
    the coupled rule its drafts are kept exactly when they equal the target's noisy sample, so
    the text is the same whichever source drafts (or none), also with the task index warm."""
    motif = random_prompts([6], 128, seed=9)[0]
    prompts = [motif * 4 + p for p in random_prompts(LENGTHS, 128, seed=2)]     # repeats to match
    params = _params(temperature=0.7, top_k=8)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=8)
    ref = [o.token_ids for o in engine.generate(prompts, params, gamma=0, draft="none")]
    for draft, gamma in (("ngram", 3), ("ngram", "auto"), ("mtp", 3), ("auto", "auto"), ("ngram", 5)):
        engine.reset_stats()
        out = [o.token_ids for o in engine.generate(prompts, params, gamma=gamma, draft=draft, task="t")]
        assert out == ref, (draft, gamma)
        if draft == "ngram" and gamma == 3:
            drafted = engine.stats.drafted_by_source.get("ngram", 0)
            accepted = engine.stats.accepted_by_source.get("ngram", 0)
            assert 0 < accepted < drafted, (accepted, drafted)     # n-gram drafts kept and rejected


@pytest.mark.parametrize("variant", [dict(temperature=0.8), dict(temperature=0.8, top_k=20)], ids=["full", "top_k"])
def test_every_pick_of_a_cpu_call_draws_the_c_noise(path, monkeypatch, variant):
    """On CPU with the C kernels, every coupled pick (the heads' drafts, the target's tokens;
    the full vocabulary and a filter's kept tokens) takes its noise from native.exponential_noise
    and none from torch's: one function for all of a call's noise, so a draft and the target's
    token at its position always compare the same values."""
    from pipeline.model import native
    from pipeline.spec_decode import rng
    if native.library() is None:
        pytest.skip("the C kernels do not build on this machine")
    calls = {"c": 0, "torch": 0}
    real_c, real_torch = native.exponential_noise, rng.exponential_noise

    def c(*a, **kw):
        calls["c"] += 1
        return real_c(*a, **kw)

    def torch_noise(*a, **kw):
        calls["torch"] += 1
        return real_torch(*a, **kw)

    monkeypatch.setattr(native, "exponential_noise", c)
    monkeypatch.setattr(rng, "exponential_noise", torch_noise)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4)
    prompts = random_prompts(LENGTHS[:6], 128, seed=2)
    outs = _tokens(engine, prompts, _params(**variant), 2)
    assert calls["c"] > 0 and calls["torch"] == 0 and engine.stats.acceptance_by_depth()[0] > 0
    assert all(len(o) == 24 for o in outs)
