"""resume=true refuses a run whose checkpoint or dataset changed since it started, naming what
changed, even when model.path and data.path are the same strings; overwrite=true starts over.
No Ray: the run directory is opened and one shard committed as the driver does."""
import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file, save_file

from pipeline.config import RunConfig, UserError
from pipeline.data.outputs import error_results, output_table
from pipeline.data.record import open_run
from pipeline.model.tiny import make_tiny_checkpoint

NUM_ROWS = 8


def rows(n, word="fox"):
    return pa.table({"id": [f"r{i}" for i in range(n)], "prompt": [f"the {word} {i}" for i in range(n)]})


@pytest.fixture
def run(tmp_path):
    """A run that committed its first shard, and a way to reopen it with other flags."""
    model = make_tiny_checkpoint(tmp_path / "model", arch="llama", num_mtp_layers=1)
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(rows(NUM_ROWS), data / "a.parquet")
    raw = {"model": {"path": str(model)}, "data": {"path": str(data), "id_column": "id"},
           "output": {"dir": str(tmp_path / "run")}, "shards": {"rows_per_shard": 4},
           "spec": {"gamma": 0}}
    record = open_run(RunConfig.from_dict(raw), raw)
    shard = record.plan[0]
    table = output_table(pa.array([f"r{i}" for i in range(shard.num_rows)]), ["p"] * shard.num_rows,
                         error_results(shard.num_rows, "x"))
    record.commit(shard, table, [{"shard_id": 0, "task": "default", "num_rows": shard.num_rows}])

    def reopen(**flags):
        flagged = raw | flags
        return open_run(RunConfig.from_dict(flagged), flagged)
    return model, data, reopen


def refusal(reopen) -> str:
    with pytest.raises(UserError) as info:
        reopen(resume=True)
    return str(info.value)


def test_unchanged_inputs_resume(run):
    _, _, reopen = run
    record = reopen(resume=True)
    assert [s.shard_id for s in record.pending()] == [1]
    assert [r["shard_id"] for r in record.committed_stats()] == [0]
    assert record.totals()["rows"] == 4


def test_new_weights_of_the_same_shapes_are_refused(run):
    model, _, reopen = run
    path = model / "model.safetensors"
    weights = load_file(str(path))
    name = sorted(weights)[-1]
    weights[name] = weights[name] + 1.0                       # same header, other values
    save_file(weights, str(path), metadata={"format": "pt"})
    said = refusal(reopen)
    assert "inputs changed" in said and "model.path: model.safetensors: sample " in said
    assert "overwrite=true" in said
    assert len(reopen(overwrite=True).pending()) == 2         # overwrite=true starts over


def test_changed_config_json_and_an_added_weight_file_are_named(run):
    model, _, reopen = run
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"rope_theta": 1234.0}))
    shutil.copy(model / "model.safetensors", model / "extra.safetensors")
    said = refusal(reopen)
    assert "model.path: config.json: sha " in said
    assert "model.path: checkpoint file added: extra.safetensors" in said


def test_changed_dataset_is_refused_naming_the_file(run):
    _, data, reopen = run
    pq.write_table(rows(NUM_ROWS, word="cat"), data / "a.parquet")   # same rows, other text
    said = refusal(reopen)
    assert f"data.path: {data / 'a.parquet'}: footer " in said and "rows 8" not in said
    pq.write_table(rows(NUM_ROWS + 1), data / "a.parquet")            # a row more
    assert "rows 8 -> 9" in refusal(reopen)
    pq.write_table(rows(NUM_ROWS), data / "a.parquet")
    pq.write_table(rows(2), data / "b.parquet")                       # a file more
    assert f"data.path: dataset file added: {data / 'b.parquet'}" in refusal(reopen)
    record = reopen(overwrite=True)
    assert len(record.pending()) == len(record.plan) == 3
