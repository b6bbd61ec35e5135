"""Admission prefills prompts of similar length together, so little of a forward is padding."""
import random

from pipeline.engine import Engine, SamplingParams
from pipeline.engine.run import PAD_SLACK, prefill_groups
from tests.tiny_models import hf_greedy, random_prompts, tiny_checkpoint


def test_groups_cover_every_prompt_once_within_the_padding_bound():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([rng.randint(1, 20), rng.randint(1, 400)]) for _ in range(rng.randint(1, 64))]
        groups = prefill_groups(lengths)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        for g in groups:
            assert len(g) * max(lengths[i] for i in g) <= PAD_SLACK * sum(lengths[i] for i in g) + 1e-9


def test_similar_lengths_share_one_forward():
    assert prefill_groups([50, 52, 49, 51]) == [[2, 0, 3, 1]]
    assert prefill_groups([5, 100, 6, 90]) == [[0, 2], [3, 1]]
    assert prefill_groups([]) == []


def test_mixed_lengths_are_prefilled_with_little_padding_and_the_same_tokens(tmp_path):
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, draftable=0.1, with_tokenizer=False)
    prompts = random_prompts([3, 40, 4, 38, 5, 36, 2, 41], 128, seed=3)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=8)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True), gamma=2)
    computed = sum(p.tokens for p in engine.last_stats.prefills)
    assert computed <= PAD_SLACK * sum(map(len, prompts))        # one padded forward: 8 x 41 = 328 of 169
    assert len(engine.last_stats.prefills) >= 2
    assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 6)
