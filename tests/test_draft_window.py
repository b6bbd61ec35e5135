"""The MTP heads' prompt window (pipeline.model.draft_window, MTPSource.after_prefill): a long
prompt's heads' fill covers only its last W tokens, the keys before stay masked, the text is
the same at every window (greedy and coupled sampling), and the window comes from the
checkpoint's file unless the run's config sets one."""
import json

import pytest
import torch

from pipeline.engine import Engine, SamplingParams
from pipeline.engine.drafter import Drafter
from pipeline.engine.drafters.mtp import MTPSource
from pipeline.model.draft_window import FILE, choose_window, read_draft_window, write_draft_window
from tests.tiny_models import hf_greedy, random_prompts, tiny_checkpoint

LENGTHS = [5, 9, 3, 12, 7, 1, 15, 4]
MAX_NEW = 12


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt")), arch="llama", num_mtp_layers=2,
                           draftable=0.05, with_tokenizer=False)


def _fills(monkeypatch):
    """Every prompt fill the heads are handed: (starts, counts) per call."""
    seen = []
    real = Drafter.add_prompt

    def spy(self, fill, slots, lengths):
        seen.append((fill.start.tolist(), fill.count.tolist(), list(lengths)))
        return real(self, fill, slots, lengths)
    monkeypatch.setattr(Drafter, "add_prompt", spy)
    return seen


def test_greedy_text_is_transformers_at_every_window(path, monkeypatch):
    prompts = random_prompts(LENGTHS, 128, seed=4)
    ref = hf_greedy(path, prompts, MAX_NEW)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=3)
    assert engine.draft_window == 0                        # no draft_window.json: whole prompts
    fills = _fills(monkeypatch)
    for window in (0, 4, 1):
        engine.draft_window = window
        for gamma in (1, 3, "auto"):
            fills.clear()
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), gamma=gamma)
            assert [o.token_ids for o in outs] == ref, (window, gamma)
            starts = [s for f in fills for s in f[0]]
            counts = [c for f in fills for c in f[1]]
            assert sorted(counts) == sorted(min(n, window or n) for n in LENGTHS), (window, gamma)
            assert sorted(starts) == sorted(max(n - (window or n), 0) for n in LENGTHS)
            assert all(c == n for f in fills for c, n in zip(f[1], f[2]))   # the policy prices what runs


def test_coupled_text_is_the_same_at_every_window(path):
    prompts = random_prompts(LENGTHS, 128, seed=5)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=2, verify="coupled", ignore_eos=True)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4)
    ref = [o.token_ids for o in engine.generate(prompts, params, gamma=0)]
    for window in (4, 2):
        engine.draft_window = window
        engine.reset_stats()
        assert [o.token_ids for o in engine.generate(prompts, params, gamma=3)] == ref, window
        assert engine.stats.acceptance_by_depth()[0] > 0


def test_a_windowed_fill_leaves_the_keys_before_it_masked(path):
    """Rows of 10 and 3 prompt tokens, window 4: the heads' first fill marks keys 6..9 of row 0
    and 0..2 of row 1 valid (head 2: from its second position on, having no carry before the
    window), and nothing before them; a row with a gap after its prompt carries nothing across
    it, as after a whole prompt's fill; drafting then runs from there."""
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=2)
    engine.draft_window = 4
    source = MTPSource.for_engine(engine, 2, 32)
    d = source.drafter
    d.reset_rows(torch.arange(2))
    lens = torch.tensor([10, 3])
    hidden = torch.randn(2, 10, engine.config.hidden_size)
    ids = torch.randint(0, 128, (2, 10))
    source.after_prefill(torch.arange(2), hidden, ids, lens, torch.tensor([7, 8]))
    d.gap[0] = True                  # row 0 lost tokens after its prompt (a backlog overflow): no carry crosses
    with torch.inference_mode():
        drafts, _ = d.propose(2, lens, 2, lambda lg, _: (lg.argmax(-1), None))
    assert drafts.shape == (2, 2)
    assert d.carry_ok.tolist()[:2] == [False, True]               # a prompt's fill, windowed or not
    valid = d.valid[:, :, :10]
    assert valid[0, 0].tolist() == [False] * 6 + [True] * 4
    assert valid[0, 1, :3].tolist() == [True] * 3 and not valid[0, 1, 3:].any()
    assert valid[1, 0].tolist() == [False] * 7 + [True] * 3          # head 2: no carry into position 6
    assert valid[1, 1, :3].tolist() == [False, True, True]


def test_the_window_is_read_from_the_checkpoint(tmp_path):
    assert read_draft_window(tmp_path) == 0                      # no file
    (tmp_path / FILE).write_text("{not json")
    assert read_draft_window(tmp_path) == 0
    measured = {0: {"a": 3.0, "b": 2.0}, 32: {"a": 3.1, "b": 1.9}, 64: {"a": 3.0, "b": 1.99}, 128: {"a": 3.0, "b": 2.0}}
    assert choose_window(measured) == 64                         # 32 keeps b at 0.95 of the whole prompt's
    assert choose_window({0: {"a": 3.0}, 16: {"a": 2.0}}) == 0
    write_draft_window(tmp_path, choose_window(measured), measured, "test")
    body = json.loads((tmp_path / FILE).read_text())
    assert body["prompt_tokens"] == 64 and body["measured"]["32"] == {"a": 3.1, "b": 1.9}
    assert read_draft_window(tmp_path) == 64


def test_an_engine_takes_its_checkpoints_window_and_a_shard_task_overrides_it(tmp_path, path, monkeypatch):
    import shutil

    import pipeline.cluster.worker as worker
    ckpt = tmp_path / "ckpt"
    shutil.copytree(path, ckpt)
    write_draft_window(ckpt, 6, {0: {"a": 1.0}, 6: {"a": 1.0}}, "test")
    engine = Engine.from_pretrained(str(ckpt), device="cpu", max_batch_size=2)
    assert engine.draft_window == 6

    class Stop(Exception):
        pass

    def read_rows(task):
        raise Stop                                   # the engine's settings are made before any row is read
    monkeypatch.setattr(worker, "read_task_rows", read_rows)
    with pytest.raises(Stop):
        worker.process_shard(engine, worker.ShardTask(None, 1, (), (), None, (), SamplingParams(), "auto"), {})
    assert engine.draft_window == 6                              # spec.draft_window null: the checkpoint's
    with pytest.raises(Stop):
        worker.process_shard(engine, worker.ShardTask(None, 1, (), (), None, (), SamplingParams(), "auto",
                                                      draft_window=2), {})
    assert engine.draft_window == 2


def test_the_build_measures_and_stores_the_demos_window(tmp_path):
    """The demo build's `window` stage: every window's text checked against the whole prompt's,
    the rule's choice written beside the heads, the engine put back to its own window."""
    import shutil
    from pathlib import Path

    from pipeline.demo.build import write_window
    assets = Path(__file__).resolve().parents[1] / "pipeline" / "assets" / "demo"
    model = tmp_path / "model"
    shutil.copytree(assets / "model", model)
    (model / FILE).unlink()
    chosen = write_window(model, assets / "data" / "demo.parquet", "cpu", lambda _: None, tasks=("json",),
                          windows=(0, 8), prompts=2, batch=2, long_tokens=64, new=8)
    body = json.loads((model / FILE).read_text())
    assert body["prompt_tokens"] == chosen == read_draft_window(model) and chosen in (0, 8)
    assert set(body["measured"]) == {"0", "8"} and set(body["measured"]["8"]) == {"json/data", "json/long"}
    assert all(v > 1 for v in body["measured"]["0"].values())              # drafts were kept
    assert choose_window({int(w): v for w, v in body["measured"].items()}) == chosen


def test_a_window_is_measured_on_any_parquet_column(tmp_path):
    """benchmarks/draft_window.py --column: another dataset's prompts as they are, one cell per
    prompt length, the text checked at each window."""
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.bench.draft_window import measure_windows, tokens_per_step
    assets = Path(__file__).resolve().parents[1] / "pipeline" / "assets" / "demo"
    rows = pq.read_table(assets / "data" / "demo.parquet", columns=["text"]).column("text").to_pylist()[:6]
    data = tmp_path / "mine.parquet"
    pq.write_table(pa.table({"prompt": [None] + [f"Summarize:\n{t}\n" for t in rows]}), data)
    engine = Engine.from_pretrained(str(assets / "model"), device="cpu", max_batch_size=2)
    cells = measure_windows(engine, str(data), (), (0, 8), prompts=2, batch=2, long_tokens=64, new=6, column="prompt")
    assert set(cells) == {"prompt/data", "prompt/long"} and cells["prompt/long"]["prompt_tokens"] >= 64
    assert engine.draft_window == read_draft_window(assets / "model")   # the engine's own window, put back
    assert set(tokens_per_step(cells, (0, 8))) == {0, 8}


def test_the_driver_hands_spec_draft_window_to_each_shard_task():
    from types import SimpleNamespace

    from pipeline.cluster.driver import _task
    from pipeline.config import RunConfig
    from tests.test_config import base
    record = SimpleNamespace(attempts={}, source=SimpleNamespace(files=("f",), file_rows=(3,)), output_dir="out")
    t = SimpleNamespace(shard=SimpleNamespace(shard_id=0), attempt=1, probe=None, bad_rows=())
    for window in (None, 0, 48):
        cfg = RunConfig.from_dict(base(spec__draft_window=window))
        assert _task(cfg, record, t).draft_window == window
