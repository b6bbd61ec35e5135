"""The driver's plans on Ray: a task nobody has seen is calibrated in one shard, not once per
actor, and not at all when the checkpoint ships a prior; every stats row carries the plan."""
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import RunConfig
from pipeline.data import read_stats
from pipeline.model.spec_prior import read_spec_prior, write_spec_prior

ray = pytest.importorskip("ray")

NUM_SHARDS, ROWS_PER_SHARD = 8, 12
PLAN_COLUMNS = ("planned_gamma", "gamma", "gamma_steps", "calibration_steps", "prior_row_steps", "prior_source",
                "reached_by_depth", "accepted_by_depth")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from pipeline.model.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("plan")
    model = make_tiny_checkpoint(root / "model", arch="llama", num_mtp_layers=1, seed=0, eos_token_id=127)
    n = NUM_SHARDS * ROWS_PER_SHARD
    pq.write_table(pa.table({"prompt": [f"the quick brown fox {i}" for i in range(n)]}), root / "d.parquet")
    return root, model


def run(root, model, name):
    from pipeline.cluster.driver import run_generation

    raw = {"model": {"path": str(model), "device": "cpu"}, "data": {"path": str(root / "d.parquet")},
           "output": {"dir": str(root / name)}, "sampling": {"max_new_tokens": 32},
           "spec": {"gamma": "auto", "gamma_max": 3}, "engine": {"max_batch_size": 4},
           "shards": {"rows_per_shard": ROWS_PER_SHARD}, "cluster": {"num_actors": 2, "cpus_per_actor": 1}}
    manifest = run_generation(RunConfig.from_dict(raw), raw, progress=False)
    assert manifest["status"] == "finished"
    stats = read_stats(root / name).to_pylist()
    assert len(stats) == NUM_SHARDS and {r["task"] for r in stats} == {"default"}
    for r in stats:
        assert all(c in r for c in PLAN_COLUMNS)
        assert sum(r["gamma_steps"]) > 0 and r["calibration_steps"] is not None
        assert r["prior_row_steps"] is not None and r["prior_source"]
    steps = sum(sum(r["gamma_steps"]) for r in stats)
    assert sum(manifest["totals"]["gamma_histogram"].values()) == steps      # steps per gamma, not rows
    return stats


def test_an_unseen_task_calibrates_in_one_shard_of_a_two_actor_run(assets, ray_session):
    root, model = assets
    stats = run(root, model, "fresh")
    calibrated = [r["shard_id"] for r in stats if r["calibration_steps"]]
    assert len(calibrated) == 1, [(r["shard_id"], r["calibration_steps"], r["gamma_reason"]) for r in stats]
    later = [r for r in stats if r["shard_id"] not in calibrated and r["prior_row_steps"] >= 256]
    assert later and all(r["prior_source"] == "this run" for r in later)   # the merged evidence was planned from
    assert all(r["planned_gamma"] is not None for r in later)
    # and the run's evidence can start another run: spec.prior=RUN_DIR
    from pipeline.cluster.planner import run_counts
    reached, accepted = run_counts(str(root / "fresh"))["default"]
    assert reached[0] == sum(r["reached_by_depth"][0] for r in stats if r["reached_by_depth"])
    from pipeline.cluster.planner import Planner
    raw = {"model": {"path": str(model)}, "data": {"path": "x"}, "output": {"dir": "y"},
           "spec": {"prior": str(root / "fresh")}}
    planner = Planner(RunConfig.from_dict(raw))
    plan = planner.plan(0, 10, None).for_task("default")
    assert plan.prior_row_steps > 0 and plan.source == f"run {root / 'fresh'}" and not planner.evidence.leases


def test_a_checkpoint_with_a_prior_never_calibrates(assets, ray_session):
    root, model = assets
    shipped = root / "model-with-prior"
    shutil.copytree(model, shipped)
    write_spec_prior(shipped, {"default": ([400, 200, 100], [200, 100, 50])}, "constructed", 3)
    assert read_spec_prior(shipped)["*"] == ([400, 200, 100], [200, 100, 50])
    stats = run(root, shipped, "with-prior")
    assert all(r["calibration_steps"] == 0 for r in stats), [r["gamma_reason"] for r in stats]
    assert all("spec_prior.json" in r["prior_source"] for r in stats)
    assert json.loads((shipped / "spec_prior.json").read_text())["tasks"]["default"]["acceptance_by_depth"][0] == 0.5
