"""The run stops when tries keep failing (an engine that always raises): after exactly one
more failed try in a row than the pool tolerates, with status `failed`, not after giving up
every shard; a resume can continue it."""
import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import RunConfig
from pipeline.cluster.narrow import failures_tolerated
from tests.tiny_models import tiny_checkpoint

ray = pytest.importorskip("ray")
NUM_SHARDS = 12


@ray.remote(num_cpus=0)
class Counter:
    def __init__(self):
        self.n = 0

    def add(self):
        self.n += 1

    def get(self):
        return self.n


class AlwaysRaises:
    """An engine whose every generate call raises (a broken device, say), and counts itself."""

    def generate(self, prompts, params, gamma="auto", **kwargs):
        ray.get(ray.get_actor("generate-calls").add.remote())
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def broken_loader(model, engine):
    return AlwaysRaises()


def test_the_run_stops_after_repeated_failures(ray_session, tmp_path):
    from pipeline.cluster.driver import run_generation
    from pipeline.cluster.pool import ActorsKeepDying

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    calls = Counter.options(name="generate-calls").remote()
    model = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1)   # checked, not loaded
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in range(NUM_SHARDS)]}), tmp_path / "d.parquet")
    raw = {"model": {"path": model}, "data": {"path": str(tmp_path / "d.parquet")},
           "output": {"dir": str(tmp_path / "run")}, "sampling": {"max_new_tokens": 2},
           "spec": {"gamma": 0}, "shards": {"rows_per_shard": 1, "max_attempts": 2},
           "cluster": {"num_actors": 1, "cpus_per_actor": 1}}
    with pytest.raises(ActorsKeepDying, match="tries failed in a row"):
        run_generation(RunConfig.from_dict(raw), raw, progress=False, loader=broken_loader)
    tolerated = failures_tolerated(1, 2, 1)
    assert ray.get(calls.get.remote()) == tolerated + 1           # one try each, then it stopped
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    given_up = [e for e in manifest["shards"] if e["status"] == "committed"]
    assert len(given_up) < NUM_SHARDS                              # stopped, not every shard given up
    assert [e["status"] for e in manifest["shards"]].count("pending") == NUM_SHARDS - len(given_up)
    ray.kill(calls)
