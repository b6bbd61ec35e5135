"""pipeline/dist/worker.py without Ray: one shard through a stand-in engine with the Engine API."""
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import OUTPUT_COLUMNS, DataConfig, SamplingConfig
from pipeline.data import open_source, plan_shards
from pipeline.dist.utilization import UtilizationMeter, cpu_share
from pipeline.dist.worker import ShardTask, failed_shard_result, gamma_in_use, process_shard

pytest.importorskip("pipeline.engine", reason="engine package")

@dataclass
class Step:
    gamma: int

@dataclass
class FakeStats:
    steps: list = field(default_factory=list)

    def acceptance_by_depth(self):
        return [0.5, float("nan")]

    def mean_acceptance_length(self):
        return 1.5

    verify_time_s = 0.25
    draft_time_s = 0.125

@dataclass
class Out:
    text: str
    token_ids: list
    finish_reason: str = "length"
    error: str | None = None
    num_prompt_tokens: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0

class EchoEngine:
    """Echoes each prompt's length as tokens; records each call's prompts and params."""

    def __init__(self):
        self.calls = []
        self.stats = FakeStats()

    def reset_stats(self):
        self.stats = FakeStats()

    def generate(self, prompts, params, gamma="auto"):
        self.calls.append((list(prompts), params, gamma))
        self.stats.steps.append(Step(gamma if gamma != "auto" else 2))
        return [Out(text=p.upper(), token_ids=list(range(len(p) % 5 + 1)),
                    num_prompt_tokens=len(p), num_drafted_tokens=4, num_accepted_tokens=2)
                for p in prompts]

@pytest.fixture
def task_factory(tmp_path):
    rows = {"uid": [f"u{i}" for i in range(12)], "task": ["a", "b", "a"] * 4,
            "text": [f"doc {i}" if i != 5 else None for i in range(12)],
            "ref": list(range(12))}
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table(rows), path, row_group_size=5)
    source = open_source(str(path))
    data = DataConfig(path=str(path), template="S: {text}", id_column="uid", task_column="task")

    def make(shard_index=0, gamma=3, rows_per_shard=8):
        shard = plan_shards(source, rows_per_shard)[shard_index]
        return ShardTask(shard, 1, source.files, source.file_rows, data, ("ref",),
                         SamplingConfig(max_new_tokens=8), gamma)
    return make

def test_shard_rows_come_back_in_order_with_errors_kept(task_factory):
    engine = EchoEngine()
    result = process_shard(engine, task_factory(), {"device": "cpu", "threads": 1})
    out = result.table
    assert tuple(out.column_names) == OUTPUT_COLUMNS + ("ref",)
    assert out["id"].to_pylist() == [f"u{i}" for i in range(8)]
    assert out["ref"].to_pylist() == list(range(8))
    row5 = out.slice(5, 1).to_pylist()[0]
    assert row5["finish_reason"] == "error" and "null" in row5["error"]
    assert out["generated_text"][0].as_py() == "S: DOC 0"
    # one generate call per task, the null-text row never reaches the engine
    assert sorted(len(c[0]) for c in engine.calls) == [3, 4]
    assert {s["task"] for s in result.stats_rows} == {"a", "b"}
    assert sum(s["num_rows"] for s in result.stats_rows) == 8
    assert sum(s["num_errors"] for s in result.stats_rows) == 1
    first = result.stats_rows[0]
    assert first["gamma"] == 3 and "fixed" in first["gamma_reason"]
    assert first["acceptance_by_depth"] == [0.5, None]
    assert first["gamma_candidates"] == [] and first["predicted_goodput"] == []

def test_task_groups_get_distinct_seeds(task_factory):
    engine = EchoEngine()
    process_shard(engine, task_factory(), {})
    process_shard(engine, task_factory(shard_index=1), {})
    seeds = [c[1].seed for c in engine.calls]
    assert len(set(seeds)) == len(seeds)

def test_failed_shard_keeps_every_row(task_factory):
    result = failed_shard_result(task_factory(shard_index=1), "actor died")
    assert result.table["id"].to_pylist() == [f"u{i}" for i in range(8, 12)]
    assert set(result.table["error"].to_pylist()) == {"actor died"}
    assert sum(s["num_errors"] for s in result.stats_rows) == 4

def test_gamma_in_use_and_cpu_share():
    stats = FakeStats(steps=[Step(1), Step(4), Step(4)])
    assert gamma_in_use(stats, "auto")[0] == 4
    assert gamma_in_use(FakeStats(), "auto")[0] is None
    assert gamma_in_use(stats, 0) == (0, "fixed by config (spec.gamma=0)")
    assert cpu_share(1.0, 2.0, 1) == 0.5
    assert cpu_share(1.0, 0.0, 1) is None


def test_utilization_meter_on_cpu_sees_a_busy_loop():
    with UtilizationMeter("cpu", threads=1) as meter:
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:
            pass
    assert 0.0 < meter.value <= 1.0
    with UtilizationMeter("cuda:0") as meter:   # no GPU or no NVML here: None, not a crash
        pass
    assert meter.value is None or 0.0 <= meter.value <= 1.0
