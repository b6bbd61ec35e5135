"""End to end on Ray: a tiny checkpoint, 2 actors, several shards; every id exactly once with
DESIGN.md's columns; resume redoes nothing, or only what is missing."""
import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline.config import OUTPUT_COLUMNS, RunConfig, UserError
from pipeline.data.outputs import STATS_SCHEMA
from pipeline.recipes import CONF_DIR, REPO_ROOT
from pipeline.run import register_resolvers
from pipeline.data.stats_files import read_stats

ray = pytest.importorskip("ray")

DESIGN_STATS = ["shard_id", "task", "num_rows", "planned_gamma", "gamma", "gamma_steps", "calibration_steps",
                "prior_row_steps", "gamma_reason", "gamma_candidates",
                "predicted_goodput", "acceptance_by_depth", "mean_acceptance_length",
                "drafted_by_source", "accepted_by_source", "tokens_per_s", "draft_time_s", "verify_time_s", "wall_time_s", "utilization",
                "device", "actor_id", "node_id", "attempt"]
NUM_ROWS = 23


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from pipeline.model.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("assets")
    model = make_tiny_checkpoint(root / "model", arch="llama", num_mtp_layers=1, seed=0)
    tasks = ["summarize", "qa", "summarize"]
    rows = {"id": [f"doc-{i:03d}" for i in range(NUM_ROWS)],
            "task": [tasks[i % 3] for i in range(NUM_ROWS)],
            "text": [f"the quick brown fox {i}" for i in range(NUM_ROWS)],
            "reference": [f"fox {i}" for i in range(NUM_ROWS)]}
    (root / "data").mkdir()
    pq.write_table(pa.table(rows).slice(0, 10), root / "data" / "a.parquet")
    pq.write_table(pa.table(rows).slice(10), root / "data" / "b.parquet", row_group_size=4)
    return {"model": str(model), "data": str(root / "data"), "rows": rows}



def job_cfg(assets, out_dir, *overrides):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=[
            "+job=summarize", f"model.path={assets['model']}", f"data.path={assets['data']}",
            f"output.dir={out_dir}", "cluster.num_actors=2", "cluster.cpus_per_actor=1",
            "shards.rows_per_shard=3", "sampling.max_new_tokens=4", "engine.max_batch_size=4",
            "spec.gamma=2", *overrides])


def outputs(out_dir):
    return ds.dataset(str(out_dir / "outputs"), format="parquet").to_table()


def manifest_steps(out_dir):
    return json.loads((out_dir / "manifest.json").read_text())["totals"]["gamma_histogram"]


def part_mtimes(out_dir):
    return {p.name: p.stat().st_mtime_ns for p in (out_dir / "outputs").glob("part-*.parquet")}


def test_run_then_resume(assets, ray_session, tmp_path):
    from pipeline.cluster.driver import main, run_generation

    out_dir = tmp_path / "run"
    cfg = job_cfg(assets, out_dir)
    assert main(cfg) == 0

    expected = [i for i, t in zip(assets["rows"]["id"], assets["rows"]["task"]) if t == "summarize"]
    table = outputs(out_dir)
    assert sorted(table["id"].to_pylist()) == sorted(expected)      # each id exactly once
    assert tuple(table.column_names) == OUTPUT_COLUMNS + ("reference",)
    assert table["error"].null_count == table.num_rows
    assert set(table["finish_reason"].to_pylist()) <= {"stop", "length"}
    by_id = dict(zip(table["id"].to_pylist(), table["reference"].to_pylist()))
    assert all(by_id[i] == assets["rows"]["reference"][int(i[4:])] for i in expected)
    assert all(p.startswith("Summarize:\nthe quick brown fox") for p in table["prompt"].to_pylist())

    stats = read_stats(out_dir)
    assert stats.schema.names[:len(DESIGN_STATS)] == DESIGN_STATS
    assert stats.schema.equals(STATS_SCHEMA)
    num_shards = -(-len(expected) // 3)
    assert sorted(stats["shard_id"].to_pylist()) == list(range(num_shards))
    assert sum(stats["num_rows"].to_pylist()) == len(expected)
    assert set(stats["gamma"].to_pylist()) == {2} and set(stats["planned_gamma"].to_pylist()) == {2}
    assert all(len(s) == 3 and s[2] > 0 and not any(s[:2]) for s in stats["gamma_steps"].to_pylist())
    assert manifest_steps(out_dir) == {"2": sum(s[2] for s in stats["gamma_steps"].to_pylist())}
    assert all(len(a) >= 1 for a in stats["acceptance_by_depth"].to_pylist())

    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["status"] == "finished"
    assert manifest["totals"]["rows"] == len(expected)
    assert manifest["totals"]["generated_tokens"] == sum(table["num_generated_tokens"].to_pylist())
    assert [s["status"] for s in manifest["shards"]] == ["committed"] * num_shards
    assert manifest["config"]["spec"]["gamma"] == 2 and "torch" in manifest["versions"]

    # resume a finished run: nothing is redone, nothing is rewritten
    before = part_mtimes(out_dir)
    first_tok_s = manifest["totals"]["tokens_per_s"]
    assert first_tok_s > 0
    run_cfg = RunConfig.from_dict(OmegaConf.to_container(job_cfg(assets, out_dir, "resume=true"),
                                                         resolve=True))
    manifest = run_generation(run_cfg, {}, progress=False)
    assert manifest["status"] == "finished"
    assert manifest["totals"]["tokens_per_s"] == first_tok_s   # the measurement is kept
    assert part_mtimes(out_dir) == before
    assert read_stats(out_dir).equals(stats)

    # lose one shard: resume redoes that shard only
    (out_dir / "outputs" / "part-00001.parquet").unlink()
    manifest = run_generation(run_cfg, {}, progress=False)
    after = part_mtimes(out_dir)
    assert set(after) == set(before)
    assert {k for k in after if after[k] != before[k]} == {"part-00001.parquet"}
    assert sorted(outputs(out_dir)["id"].to_pylist()) == sorted(expected)
    assert manifest["totals"]["rows"] == len(expected)

    # without resume, a directory with committed shards is refused
    fresh = RunConfig.from_dict(OmegaConf.to_container(job_cfg(assets, out_dir), resolve=True))
    with pytest.raises(UserError, match="resume=true"):
        run_generation(fresh, {}, progress=False)
    # resuming with different settings is refused too
    other = RunConfig.from_dict(OmegaConf.to_container(
        job_cfg(assets, out_dir, "resume=true", "sampling.seed=7"), resolve=True))
    with pytest.raises(UserError, match=r"config differs .*: sampling\.seed: 0 -> 7\. "):
        run_generation(other, {}, progress=False)


def test_missing_model_is_a_message_not_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.run", "+job=summarize",
         f"model.path={tmp_path / 'no-model'}", f"output.dir={tmp_path / 'run'}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "no-model" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_demo_assets_name_the_build_command():
    from pipeline.cluster.driver import DEMO_DIR, check_inputs

    raw = {"model": {"path": str(DEMO_DIR / "no-such-model")}, "data": {"path": "x.parquet"},
           "output": {"dir": "runs/x"}}
    with pytest.raises(UserError, match=r"\+job=build_demo"):
        check_inputs(RunConfig.from_dict(raw))


class CrashingEngine:
    """Wraps a real engine; the actor process exits (as on an OOM kill or a lost node) when a
    batch holds a prompt with CRASH: only the first time, or every time."""

    def __init__(self, engine, marker, always):
        self.engine, self.marker, self.always = engine, marker, always

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params, gamma="auto", **kwargs):
        if any("CRASH" in p for p in prompts) and (self.always or not self.marker.exists()):
            self.marker.touch()
            os._exit(1)
        return self.engine.generate(prompts, params, gamma=gamma, **kwargs)


def crashing_loader(marker, always):
    def load(model, engine):
        from pipeline.cluster.actor import load_engine
        return CrashingEngine(load_engine(model, engine), marker, always)
    return load


@pytest.mark.parametrize("always", [False, True])
def test_actor_deaths_lose_no_rows(assets, ray_session, tmp_path, always):
    from pipeline.cluster.driver import run_generation

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    n = 8
    texts = [f"row {i}" + (" CRASH" if i == 5 else "") for i in range(n)]
    pq.write_table(pa.table({"prompt": texts}), tmp_path / "d.parquet")
    raw = {"model": {"path": assets["model"]}, "data": {"path": str(tmp_path / "d.parquet")},
           "output": {"dir": str(tmp_path / "run")}, "sampling": {"max_new_tokens": 3},
           "spec": {"gamma": 1}, "shards": {"rows_per_shard": 3, "max_attempts": 2},
           "cluster": {"num_actors": 2, "cpus_per_actor": 1}}
    manifest = run_generation(RunConfig.from_dict(raw), raw, progress=False,
                              loader=crashing_loader(tmp_path / "crashed", always))
    assert manifest["status"] == "finished"
    table = outputs(tmp_path / "run")
    assert sorted(table["id"].to_pylist()) == list(range(n))
    errors = {i: e for i, e in zip(table["id"].to_pylist(), table["error"].to_pylist()) if e}
    stats = read_stats(tmp_path / "run").to_pylist()
    crashed_shard = [s for s in stats if s["shard_id"] == 1]
    assert [s["attempt"] for s in stats if s["shard_id"] != 1] == [1, 1]
    if always:   # both whole tries died; probes [3], [4, 5] -> [4], [5] found row 5, so try 7
        assert crashed_shard[0]["attempt"] == 7    # committed rows 3 and 4 with row 5 as an error
        assert list(errors) == [5] and "fails on its own" in errors[5] and "actor died" in errors[5]
        assert manifest["totals"]["rows_with_error"] == 1
    else:        # the retry on a fresh actor succeeded
        assert crashed_shard[0]["attempt"] == 2
        assert errors == {}


def test_pool_is_sized_to_what_the_cluster_holds(assets, ray_session, tmp_path):
    from pipeline.cluster.driver import pool_size

    cpus = int(ray.cluster_resources()["CPU"])
    raw = {"model": {"path": assets["model"]}, "data": {"path": "x"}, "output": {"dir": "y"},
           "cluster": {"num_actors": cpus + 3, "cpus_per_actor": 1}}
    cfg = RunConfig.from_dict(raw)
    assert pool_size(cfg, use_gpus=False, pending=100) == cpus
    assert pool_size(cfg, use_gpus=False, pending=1) == 1
