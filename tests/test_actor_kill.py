"""An actor killed mid-shard by `ray.kill` (from the test, on the live actor's handle) costs only
that shard: another or a restarted actor redoes it, and its `attempt` says so. (A shard that
keeps failing because of one row: tests/test_cluster_run.py::test_actor_deaths_lose_no_rows.)"""
import json
import sys
import threading
import time

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from pipeline.config import RunConfig
from pipeline.data.stats_files import read_stats
from tests.tiny_models import tiny_checkpoint

ray = pytest.importorskip("ray")



@ray.remote(num_cpus=0)
class Mailbox:
    def __init__(self):
        self.items = []

    def put(self, item):
        self.items.append(item)

    def get(self):
        return list(self.items)


class HoldsStill:
    """Wraps a real engine; on a batch holding HOLD (the first time only) it posts its own actor
    handle to the test's mailbox and waits there to be killed."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params, gamma="auto", **kwargs):
        if any("HOLD" in p for p in prompts):
            box = ray.get_actor("mailbox")
            if not ray.get(box.get.remote()):
                box.put.remote([ray.get_runtime_context().current_actor])
                time.sleep(300)
        return self.engine.generate(prompts, params, gamma=gamma, **kwargs)


def holding_loader(model, engine):
    from pipeline.cluster.actor import load_engine
    return HoldsStill(load_engine(model, engine))


def test_ray_kill_mid_shard_costs_only_that_shard(ray_session, tmp_path):
    from pipeline.cluster.driver import run_generation

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    box = Mailbox.options(name="mailbox").remote()
    model = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1)
    texts = [f"row {i}" + (" HOLD" if i == 7 else "") for i in range(12)]
    pq.write_table(pa.table({"prompt": texts}), tmp_path / "d.parquet")
    raw = {"model": {"path": model}, "data": {"path": str(tmp_path / "d.parquet")},
           "output": {"dir": str(tmp_path / "run")}, "sampling": {"max_new_tokens": 3},
           "spec": {"gamma": 1}, "shards": {"rows_per_shard": 3, "max_attempts": 2},
           "cluster": {"num_actors": 2, "cpus_per_actor": 1}}
    killed = []

    def killer():
        deadline = time.monotonic() + 120
        while not (posted := ray.get(box.get.remote())) and time.monotonic() < deadline:
            time.sleep(0.05)
        if posted:
            ray.kill(posted[0][0])                 # the live actor, mid-shard
            killed.append(posted[0][0])

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    manifest = run_generation(RunConfig.from_dict(raw), raw, progress=False, loader=holding_loader)
    thread.join(timeout=5)
    ray.kill(box)
    assert len(killed) == 1 and manifest["status"] == "finished"
    table = ds.dataset(str(tmp_path / "run" / "outputs"), format="parquet").to_table()
    assert sorted(table["id"].to_pylist()) == list(range(12))       # every id exactly once
    assert table["error"].null_count == 12
    stats = read_stats(tmp_path / "run").to_pylist()
    attempts = {s["shard_id"]: s["attempt"] for s in stats}
    assert attempts == {0: 1, 1: 1, 2: 2, 3: 1}                     # row 7 is in shard 2
    killed_id = killed[0]._actor_id.hex()
    assert stats[2]["actor_id"] != killed_id                        # redone elsewhere
    assert {e["shard_id"]: e["attempts"] for e in manifest["shards"]}[2] == 2



def test_a_shard_that_cannot_be_read_stops_the_run_with_its_message(ray_session, tmp_path):
    from pipeline.config import UserError
    from pipeline.cluster.driver import run_generation

    model = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1)
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": [f"row {i} " * 50 for i in range(40)]}), path,
                   compression="none", row_group_size=20)
    raw = {"model": {"path": model}, "data": {"path": str(path)},
           "output": {"dir": str(tmp_path / "run")}, "sampling": {"max_new_tokens": 2},
           "spec": {"gamma": 0}, "shards": {"rows_per_shard": 20},
           "cluster": {"num_actors": 1, "cpus_per_actor": 1}}
    cfg = RunConfig.from_dict(raw)
    data = bytearray(path.read_bytes())
    start = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset
    data[start:start + 64] = b"\xff" * 64          # planning reads footers only: it still plans
    path.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"cannot read rows \[20, 40\).*d\.parquet") as info:
        run_generation(cfg, raw, progress=False)
    assert "Traceback" not in str(info.value)
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    assert [s["status"] for s in manifest["shards"]] == ["committed", "pending"]
