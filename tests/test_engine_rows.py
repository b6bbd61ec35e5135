"""Bad input fails per row, not per call; stop strings; argument checks."""
import pytest

from pipeline.engine import Engine, SamplingParams
from tests.tiny_models import random_prompts, tiny_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt")), arch="llama", num_mtp_layers=1,
                           draftable=0.1, max_position_embeddings=64)
    return Engine.from_pretrained(path, device="cpu", max_batch_size=4)


def test_bad_rows_get_errors_and_good_rows_complete(engine):
    good = random_prompts([5, 8], 128, seed=9)
    prompts = [good[0], "", [], list(range(3, 70)), 12345, "def add(a, b):", good[1]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True), gamma=3)
    assert len(outs) == len(prompts)
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "error", "length", "length"]
    assert "empty prompt" in outs[1].error and "empty prompt" in outs[2].error
    assert "67 tokens" in outs[3].error and "context is 64" in outs[3].error
    assert "string or a list of token ids" in outs[4].error
    assert all(o.error is None and len(o.token_ids) == 8 for o in (outs[0], outs[5], outs[6]))
    assert outs[5].num_prompt_tokens > 0 and isinstance(outs[5].text, str)
    # the good rows are exactly what they are when run alone
    alone = engine.generate([good[0], good[1]], SamplingParams(max_new_tokens=8, ignore_eos=True), gamma=0)
    assert [outs[0].token_ids, outs[6].token_ids] == [o.token_ids for o in alone]


def test_truncation_and_context_cap(engine):
    long = list(range(3, 70))
    out = engine.generate([long], SamplingParams(max_new_tokens=10, truncate_prompt=True, ignore_eos=True), gamma=3)[0]
    assert out.error is None and out.num_prompt_tokens == 54 and len(out.token_ids) == 10
    near_full = list(range(3, 63))          # 60 tokens: only 4 fit in a 64-token context
    out = engine.generate([near_full], SamplingParams(max_new_tokens=10, ignore_eos=True), gamma=3)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_stop_strings_cut_the_text(engine):
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    free = engine.generate(["the quick brown"], params, gamma=2)[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    out = engine.generate(["the quick brown"], SamplingParams(max_new_tokens=30, ignore_eos=True, stop=[stop]), gamma=2)[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and free.text.startswith(out.text)
    assert len(out.token_ids) < 30


def test_argument_checks(engine, tmp_path):
    with pytest.raises(ValueError, match="gamma"):
        engine.generate([[5, 6]], SamplingParams(), gamma=-1)
    with pytest.raises(ValueError, match="gamma"):
        engine.generate([[5, 6]], SamplingParams(), gamma="fast")
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        Engine(engine.model, max_batch_size=0)
    no_heads = Engine.from_pretrained(tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=0), device="cpu")
    with pytest.raises(ValueError, match="needs MTP heads"):
        no_heads.generate([[5, 6]], SamplingParams(max_new_tokens=2), gamma=2, draft="mtp")
    no_heads.generate([[5, 6, 5, 6]], SamplingParams(max_new_tokens=4), gamma=2)     # without heads: n-grams
    assert set(no_heads.last_stats.drafted_by_source) <= {"ngram"}
    assert len(no_heads.generate([[5, 6]], SamplingParams(max_new_tokens=2), gamma="auto")[0].token_ids) >= 1
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Engine.from_pretrained(tmp_path / "missing", device="cpu")
