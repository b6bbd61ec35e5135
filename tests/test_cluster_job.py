"""DESIGN.md's cluster command, end to end: a head and a second node started with `ray start`
on 127.0.0.1, the summarize job submitted with the `ray job submit` CLI and `--working-dir`,
actors on both nodes (each node has one CPU, each actor needs one), every row in the outputs.

The job uses a tiny checkpoint and a small dataset written here (the demo assets may not be
built), passed as overrides; the nodes are stopped at the end whatever happens.
"""
import json
import subprocess

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from pipeline.recipes import REPO_ROOT
from pipeline.data.stats_files import read_stats
from tests.local_cluster import BIN, LocalCluster, node_env

pytest.importorskip("ray")
NUM_ROWS = 12


@pytest.fixture
def cluster():
    c = LocalCluster()
    try:
        c.start_head(num_cpus=1)
        c.wait_for_nodes(1, timeout=120)
        c.add_node(num_cpus=1)
        c.wait_for_nodes(2, timeout=120)
        yield c
    finally:
        c.stop()


def test_ray_job_submit_runs_summarize_on_two_nodes(cluster, tmp_path):
    from pipeline.model.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "model", arch="llama", num_mtp_layers=1, seed=0)
    rows = {"id": [f"doc-{i:02d}" for i in range(NUM_ROWS)],
            "task": ["summarize"] * NUM_ROWS,
            "text": [f"the quick brown fox {i}" for i in range(NUM_ROWS)],
            "reference": [f"fox {i}" for i in range(NUM_ROWS)]}
    pq.write_table(pa.table(rows), tmp_path / "data.parquet")
    out = tmp_path / "run"
    entrypoint = ["python", "-m", "pipeline.run", "+job=summarize", "cluster.address=auto",
                  f"model.path={model}", f"data.path={tmp_path / 'data.parquet'}",
                  f"output.dir={out}", "cluster.num_actors=2", "cluster.cpus_per_actor=1",
                  "shards.rows_per_shard=2", "sampling.max_new_tokens=4",
                  "engine.max_batch_size=2", "spec.gamma=1"]
    submit = [str(BIN / "ray"), "job", "submit", "--address", cluster.dashboard,
              "--working-dir", str(REPO_ROOT), "--", *entrypoint]
    proc = subprocess.run(submit, cwd=REPO_ROOT, env=node_env(), capture_output=True, text=True,
                          timeout=300)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert "succeeded" in proc.stdout, log

    table = ds.dataset(str(out / "outputs"), format="parquet").to_table()
    assert sorted(table["id"].to_pylist()) == rows["id"]          # every row, exactly once
    assert table["error"].null_count == NUM_ROWS
    stats = read_stats(out)
    assert sorted(stats["shard_id"].to_pylist()) == list(range(NUM_ROWS // 2))
    assert len(set(stats["node_id"].to_pylist())) == 2           # actors ran on both nodes
    assert len(set(stats["actor_id"].to_pylist())) == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["totals"]["rows"] == NUM_ROWS
    assert manifest["config"]["cluster"]["address"] == "auto"
