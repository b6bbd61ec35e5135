"""pipeline/cluster/worker.py without Ray: one shard through a stand-in engine with the Engine API."""
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import OUTPUT_COLUMNS, DataConfig
from pipeline.engine.params import SamplingParams
from pipeline.data import open_source, plan_shards
from pipeline.cluster.utilization import UtilizationMeter, cpu_share
from pipeline.cluster.worker import ShardTask, failed_shard_result, gamma_in_use, process_shard, row_key

pytest.importorskip("pipeline.engine", reason="engine package")
from pipeline.engine import RequestOutput  # noqa: E402

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

class EchoEngine:
    """Echoes each prompt's length as tokens; records each call's prompts and params."""

    def __init__(self):
        self.calls = []
        self.last_stats = FakeStats()

    def generate(self, prompts, params, gamma="auto", row_keys=None):
        self.calls.append((list(prompts), params, gamma, list(row_keys)))
        self.last_stats = FakeStats([Step(gamma if gamma != "auto" else 2)])
        return [RequestOutput(text=p.upper(), token_ids=list(range(len(p) % 5 + 1)), finish_reason="length",
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
                         SamplingParams(max_new_tokens=8), gamma)
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

def test_rows_get_stable_distinct_random_keys(task_factory):
    """Sampling randomness is keyed by row id, so it does not depend on the shard layout."""
    engine = EchoEngine()
    process_shard(engine, task_factory(), {})
    process_shard(engine, task_factory(shard_index=1), {})
    keys = [k for c in engine.calls for k in c[3]]
    assert len(set(keys)) == len(keys) == 11                     # 12 rows, one without text
    assert {c[1].seed for c in engine.calls} == {0}
    wide = EchoEngine()
    process_shard(wide, task_factory(rows_per_shard=12), {})
    assert sorted(k for c in wide.calls for k in c[3]) == sorted(keys)
    assert row_key(7) == 7 and row_key("u1") == row_key("u1") != row_key("u2")

def test_failed_shard_keeps_every_row(task_factory):
    result = failed_shard_result(task_factory(shard_index=1), "actor died")
    assert result.table["id"].to_pylist() == [f"u{i}" for i in range(8, 12)]
    assert set(result.table["error"].to_pylist()) == {"actor died"}
    assert sum(s["num_errors"] for s in result.stats_rows) == 4

def test_gamma_in_use_and_cpu_share():
    stats = FakeStats(steps=[Step(1), Step(4), Step(4)])
    assert gamma_in_use(stats, "auto")["gamma"] == 4
    assert gamma_in_use(FakeStats(), "auto")["gamma"] is None
    assert gamma_in_use(stats, 0) == {"gamma": 0, "gamma_reason": "fixed by config (spec.gamma=0)",
                                      "gamma_candidates": [], "predicted_goodput": []}
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


def test_auto_gamma_fields_come_from_the_policy_decisions():
    from pipeline.spec_decode.policy import Decision

    class Policy:
        decisions = [Decision(5, "calibrating acceptance (0/64 row-steps)", [], [], [], calibrating=True),
                     Decision(3, "rows=8: gamma=3 predicts 900 tok/s", [0, 1, 2, 3], [300.0, 600.0, 800.0, 900.0], [0.8]),
                     Decision(3, "rows=8: gamma=3 predicts 910 tok/s", [0, 1, 2, 3], [301.0, 601.0, 801.0, 910.0], [0.8]),
                     Decision(4, "rows=1: gamma=4 predicts 200 tok/s", [0, 1, 2, 3, 4], [50.0, 90, 130, 170, 200], [0.8])]

    stats = FakeStats(steps=[Step(5), Step(3), Step(3), Step(4)])
    fields = gamma_in_use(stats, "auto", Policy())
    assert fields["gamma"] == 3
    calibrating_longer = Policy()
    calibrating_longer.decisions = [Policy.decisions[0]] * 3 + Policy.decisions[1:]
    assert gamma_in_use(FakeStats(steps=[Step(5)] * 3 + stats.steps[1:]), "auto", calibrating_longer)["gamma"] == 3
    assert fields["gamma_candidates"] == [0, 1, 2, 3]
    assert fields["predicted_goodput"] == [300.0, 600.0, 800.0, 900.0]
    assert "gamma=3 predicts 900" in fields["gamma_reason"]
    assert "1 calibration steps" in fields["gamma_reason"] and "3:2" in fields["gamma_reason"]


def test_auto_gamma_on_a_real_engine_calibrates_once_per_task(tmp_path):
    """Through process_shard with the real engine: the first shard of a task calibrates, its
    acceptance becomes the prior, and the next shard of that task decides from the start."""
    from pipeline.engine import Engine
    from pipeline.spec_decode.policy import GoodputPolicy
    from tests.tiny_models import tiny_checkpoint

    path = tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_mtp_layers=1, draftable=0.05)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=8)
    rows = {"text": [f"the quick brown fox {i}" for i in range(320)]}
    pq.write_table(pa.table(rows), tmp_path / "d.parquet")
    source = open_source(str(tmp_path / "d.parquet"))
    data = DataConfig(path=str(tmp_path / "d.parquet"), prompt_column="text")
    shards = plan_shards(source, 160)         # 160 rows: past the 256 calibration row-steps even when
                                              # the tiny tokenizer's EOS ends rows after ~25 tokens
    priors = {}
    stats = []
    for shard in shards:
        task = ShardTask(shard, 1, source.files, source.file_rows, data, (),
                         SamplingParams(max_new_tokens=48), "auto", gamma_max=4)
        stats.append(process_shard(engine, task, {"device": "cpu"}, priors).stats_rows[0])
    first, second = stats
    assert "calibration steps" in first["gamma_reason"]
    assert "calibration steps" not in second["gamma_reason"]
    assert second["gamma_candidates"] == [0, 1, 2, 3, 4] and len(second["predicted_goodput"]) == 5
    goodput = second["predicted_goodput"]
    best = goodput.index(max(goodput))
    within_margin = best > 0 and goodput[best] <= goodput[0] * (1 + GoodputPolicy.min_gain)
    assert second["gamma"] == (0 if within_margin else best)
    assert priors["default"].reached[0] > 0
