"""pipeline.ray_data: the engine as a stage of a user's own Ray Data pipeline.

read_parquet -> processor -> write_parquet gives every id once, bad rows (null, empty, too
long) as error rows among good ones, and greedy text equal to what the pipeline's generate job
writes for the same rows; an engine call that raises is narrowed to its failing row and an
actor that dies is restarted and its batch retried; the stats come back per actor."""
import os
import sys

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from pipeline.cluster.data_stage import ADDED_COLUMNS, DraftView, generate_table, narrowed, with_draft
from pipeline.cluster.metrics import metric_points
from pipeline.cluster.stage_stats import StageStats
from pipeline.config import DataConfig, UserError
from pipeline.engine.params import SamplingParams
from pipeline.engine import RequestOutput
from pipeline.spec_decode.stats import SpecStats, StepRecord

ray = pytest.importorskip("ray")

N = 10
BAD = {3: "is None", 6: "context is 48", 8: "empty prompt"}     # row -> what its error says


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray with room for 2 stage actors, the collector and Ray Data's read tasks."""
    pytest.importorskip("ray.data", reason="Ray Data needs ray[data] (pandas)", exc_type=ImportError)
    ray.init(num_cpus=4, include_dashboard=False, logging_level="warning")
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from pipeline.model.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("ray_data")
    model = make_tiny_checkpoint(root / "model", num_mtp_layers=1, draftable=0.05,
                                 max_position_embeddings=48)
    prompts = [f"the quick brown fox {i}" for i in range(N)]
    prompts[3], prompts[6], prompts[8] = None, "jumps over " * 30, ""
    table = pa.table({"id": [f"r-{i:02d}" for i in range(N)], "prompt": prompts,
                      "topic": [f"t{i % 3}" for i in range(N)]})
    (root / "data").mkdir()
    pq.write_table(table.slice(0, 5), root / "data" / "a.parquet")
    pq.write_table(table.slice(5), root / "data" / "b.parquet")
    return {"model": str(model), "data": str(root / "data"), "root": root}


def pipeline_outputs(assets, out_dir):
    """The same rows through the pipeline's driver (`+job=generate` where conf/job has it, else
    the base config with the generate recipe: the same overrides)."""
    from hydra import compose, initialize_config_dir

    from pipeline.cluster.driver import main
    from pipeline.recipes import CONF_DIR
    from pipeline.run import register_resolvers

    job = (["+job=generate"] if (CONF_DIR / "job" / "generate.yaml").exists()
           else ["job.name=generate", "job.recipe=generate"])
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            *job, f"model.path={assets['model']}", f"data.path={assets['data']}",
            "data.prompt_column=prompt", "data.id_column=id", f"output.dir={out_dir}",
            "cluster.num_actors=1", "cluster.cpus_per_actor=1", "sampling.max_new_tokens=6",
            "engine.max_batch_size=4", "spec.gamma=auto"])
    assert main(cfg) == 0
    return pads.dataset(str(out_dir / "outputs"), format="parquet").to_table()


def test_parquet_through_processor_matches_pipeline(assets, ray_local, tmp_path):
    from pipeline.ray_data import build_processor

    processor = build_processor(assets["model"], prompt_column="prompt",
                                sampling=dict(max_new_tokens=6), gamma="auto", concurrency=2,
                                num_gpus=0, batch_size=3, max_batch_size=4, draft_window=4)
    assert processor.stage_kwargs["draft_window"] == 4          # each actor's engine reads 4 prompt tokens
    processor(ray.data.read_parquet(assets["data"]).repartition(2)).write_parquet(str(tmp_path / "out"))
    out = pads.dataset(str(tmp_path / "out"), format="parquet").to_table()

    assert sorted(out["id"].to_pylist()) == [f"r-{i:02d}" for i in range(N)]   # each id once
    assert out.column_names == ["id", "prompt", "topic", *ADDED_COLUMNS]
    rows = {r["id"]: r for r in out.to_pylist()}
    for i, why in BAD.items():
        r = rows[f"r-{i:02d}"]
        assert why in r["error"] and r["finish_reason"] == "error" and not r["generated_text"]
    good = [r for r in rows.values() if r["error"] is None]
    assert len(good) == N - len(BAD)
    assert all(r["finish_reason"] in ("stop", "length") and r["num_generated_tokens"] > 0 for r in good)
    assert all(r["topic"] == f"t{int(r['id'][2:]) % 3}" for r in rows.values())

    # greedy: the same text, token counts and error rows as the pipeline writes
    expected = {r["id"]: r for r in pipeline_outputs(assets, tmp_path / "run").to_pylist()}
    assert set(expected) == set(rows)
    for rid, r in rows.items():
        e = expected[rid]
        assert (r["generated_text"], r["finish_reason"], r["num_generated_tokens"]) == \
               (e["generated_text"], e["finish_reason"], e["num_generated_tokens"]), rid
        assert (r["error"] is None) == (e["error"] is None), rid

    stats = processor.stats()
    total = stats["total"]
    assert 1 <= len(stats["actors"]) <= 2
    assert sum(a["num_rows"] for a in stats["actors"]) == total["num_rows"] == N
    assert total["num_errors"] == len(BAD)
    assert total["num_generated_tokens"] == sum(out["num_generated_tokens"].to_pylist())
    assert total["num_drafted_tokens"] == sum(out["num_drafted_tokens"].to_pylist()) > 0
    assert total["num_accepted_tokens"] == sum(out["num_accepted_tokens"].to_pylist()) > 0
    assert total["acceptance_by_depth"] and 0 < total["acceptance_by_depth"][0] <= 1
    assert sum(total["gamma_steps"].values()) > 0 and total["tokens_per_s"] > 0
    assert all(a["actor_id"] and a["device"] == "cpu" for a in stats["actors"])


class FaultyEngine:
    """Wraps a real engine: a call holding a BOOM prompt raises; one holding CRASH ends the
    actor's process the first time (as an OOM kill would), then runs."""

    def __init__(self, engine, marker):
        self.engine, self.marker = engine, marker

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params, gamma="auto", **kwargs):
        if any("CRASH" in p for p in prompts) and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os._exit(1)
        if any("BOOM" in p for p in prompts):
            raise RuntimeError("injected engine failure")
        return self.engine.generate(prompts, params, gamma=gamma, **kwargs)


def faulty_loader(marker):
    def load(model, engine):
        from pipeline.cluster.actor import load_engine
        return FaultyEngine(load_engine(model, engine), marker)
    return load


def test_engine_failures_cost_only_their_rows(assets, ray_local, tmp_path):
    from pipeline.ray_data import build_processor

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    texts = [f"a fox {i}" + (" BOOM" if i == 2 else "") + (" CRASH" if i == 6 else "") for i in range(8)]
    pq.write_table(pa.table({"k": list(range(8)), "text": texts}), tmp_path / "in.parquet")
    processor = build_processor(assets["model"], prompt_column=None, template="Q: {text}",
                                sampling=dict(max_new_tokens=3), gamma=1, concurrency=1,
                                batch_size=4, loader=faulty_loader(str(tmp_path / "crashed")))
    out = processor(ray.data.read_parquet(str(tmp_path / "in.parquet"))).materialize()
    rows = {r["k"]: r for r in out.take_all()}

    assert sorted(rows) == list(range(8))
    assert (tmp_path / "crashed").exists()                 # the actor died once, and was replaced
    assert "generation failed: RuntimeError: injected engine failure" in rows[2]["error"]
    assert [k for k, r in rows.items() if r["error"]] == [2]
    assert all(rows[k]["num_generated_tokens"] == 3 for k in rows if k != 2)
    # the stats count the work done: the batch the dead actor had finished is counted again
    # by its successor, which redid the whole block
    stats = processor.stats()
    assert any(a["num_rows"] == 8 and a["num_errors"] == 1 for a in stats["actors"])
    assert stats["total"]["num_rows"] >= 8


def test_a_missing_prompt_column_stops_the_job(assets, ray_local):
    from pipeline.ray_data import build_processor

    processor = build_processor(assets["model"], prompt_column="question", concurrency=1)
    with pytest.raises(Exception, match="no column"):
        processor(ray.data.from_items([{"prompt": "hi"}])).materialize()


def test_narrowing_finds_the_failing_row():
    calls = []

    def call(rows):
        calls.append(list(rows))
        if 2 in rows:
            raise ValueError("bad row")
        return [{"generated_text": f"ok {i}", "error": None} for i in rows]

    out = narrowed(call, [0, 1, 2, 3])
    assert calls == [[0, 1, 2, 3], [0, 1], [2, 3], [2], [3]]
    assert [r["error"] for r in out] == [None, None, "generation failed: ValueError: bad row", None]
    assert out[3]["generated_text"] == "ok 3"

    def config_error(rows):
        raise UserError("the same for every row")

    with pytest.raises(UserError):
        narrowed(config_error, [0, 1])


def test_a_bad_draft_window_fails_when_the_processor_is_built():
    from pipeline.config import ConfigError
    from pipeline.ray_data import build_processor
    with pytest.raises(ConfigError, match="spec.draft_window"):
        build_processor("model", draft_window=-1)


def test_a_stage_sets_its_engines_draft_window(monkeypatch):
    """GenerateStage passes draft_window to its engine (None leaves the checkpoint's)."""
    import pipeline.cluster.actor as actor
    from pipeline.cluster.data_stage import GenerateStage

    class Engine:
        draft_window = 32

        def generate(self, prompts, params=None, gamma="auto", row_keys=None):
            return []

    class Worker:
        def __init__(self, *a):
            self.engine, self.info, self.priors = Engine(), {"actor_id": "a"}, {}
    monkeypatch.setattr(actor, "ShardWorker", Worker)
    args = (None, None, None, None, "auto", 5, "auto", 1, None, None, "run")
    assert GenerateStage(*args).engine.draft_window == 32
    assert GenerateStage(*args, draft_window=8).engine.draft_window == 8


def test_draft_is_passed_only_to_an_engine_that_takes_it():
    class Old:
        def generate(self, prompts, params=None, gamma="auto", row_keys=None):
            return "old"

    class New:
        def generate(self, prompts, params=None, gamma="auto", row_keys=None, draft="auto"):
            return draft

    assert isinstance(with_draft(Old(), "ngram"), Old)
    view = with_draft(New(), "ngram")
    assert isinstance(view, DraftView) and view.generate(["x"]) == "ngram"
    assert view.generate(["x"], draft="none") == "none"


def test_stage_stats_add_up():
    class Step:
        def __init__(self, gamma):
            self.gamma, self.draft_s, self.verify_s = gamma, 0.5, 1.0

    class Spec:
        steps, reached, accepted, row_steps, emitted_tokens = [Step(2), Step(2), Step(0)], [4, 2], [2, 1], 6, 9

    a, b = StageStats(), StageStats()
    a.observe_call(Spec(), 2.0)
    a.observe_rows([{"num_generated_tokens": 4, "error": None}, {"error": "x"}])
    b.observe_call(Spec(), 2.0)
    b.observe_rows([{"num_generated_tokens": 6, "num_drafted_tokens": 4, "num_accepted_tokens": 3}])
    s = a.merge(b).summary()
    assert s["num_rows"] == 3 and s["num_errors"] == 1 and s["batches"] == 2
    assert s["gamma_steps"] == {0: 2, 2: 4}
    assert s["acceptance_by_depth"] == [0.5, 0.5]
    assert s["mean_acceptance_length"] == 1.5 and s["tokens_per_s"] == 10 / 4.0
    assert s["verify_time_s"] == 6.0 and s["num_drafted_tokens"] == 4


class EchoEngine:
    """Upper-cases each prompt; a call holding a BOOM prompt raises; each call accepts one of
    two drafts per row in one verify step."""

    def __init__(self):
        self.calls = []
        self.last_stats = SpecStats()

    def generate(self, prompts, params, gamma="auto", row_keys=None):
        self.calls.append(list(prompts))
        if any("BOOM" in p for p in prompts):
            raise RuntimeError("boom")
        self.last_stats = SpecStats()
        self.last_stats.observe_acceptance(2, [1] * len(prompts))
        self.last_stats.observe_step(StepRecord(2, len(prompts), 3, 5.0, 5, 0.01, 0.01, 2 * len(prompts)))
        return [RequestOutput(text=p.upper(), token_ids=[5, 6], finish_reason="length",
                              num_prompt_tokens=len(p), num_drafted_tokens=2, num_accepted_tokens=1)
                for p in prompts]


def test_a_batch_as_the_pipeline_handles_a_shard():
    """Template and null rows as in pipeline.data.prompts, one call per task, a failing row
    narrowed out, the policy's evidence carried across batches, stats rows the metrics read."""
    engine, priors, stats = EchoEngine(), {}, StageStats()
    data = DataConfig(path="<ray.data>", prompt_column=None, template="Q: {text}", task_column="task")
    table = pa.table({"text": ["a", None, "b BOOM", "c", "d"], "task": ["x", "x", "y", "y", "x"]})
    info = {"device": "cpu", "threads": 1}
    results, rows = generate_table(engine, table, data, SamplingParams(max_new_tokens=2), 2, info,
                                   priors, stats, keys=[0, 1, 2, 3, 4])
    assert [r["generated_text"] for r in results] == ["Q: A", None, None, "Q: C", "Q: D"]
    assert "null" in results[1]["error"] and "RuntimeError: boom" in results[2]["error"]
    assert engine.calls == [["Q: a", "Q: d"], ["Q: b BOOM", "Q: c"], ["Q: b BOOM"], ["Q: c"]]
    assert {r["task"]: (r["num_rows"], r["num_errors"]) for r in rows} == {"x": (3, 1), "y": (2, 1)}
    assert priors["x"].row_steps == 2 and priors["y"].row_steps == 1
    generate_table(engine, table.slice(0, 1), data, SamplingParams(max_new_tokens=2), 2, info,
                   priors, stats, keys=[0])
    assert priors["x"].row_steps == 3                    # evidence kept across batches
    assert stats.summary()["acceptance_by_depth"] == [1.0, 0.0]
    points = {(name, tuple(sorted(tags.items()))): value for name, value, tags in metric_points(rows)}
    assert points[("specbatch_rows", (("task", "x"),))] == 3
    assert points[("specbatch_row_errors", (("task", "y"),))] == 1
    assert points[("specbatch_gamma", (("task", "x"),))] == 2
