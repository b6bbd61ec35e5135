"""Data layer: lazy sources (file, directory, glob), shard plans as row ranges, prompts, ids,
atomic commits and the stats/manifest files."""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import DataConfig, UserError
from pipeline.data import (build_prompts, check_columns, commit_part, committed_shards,
                           needed_columns, open_source, output_table, part_stats,
                           plan_shards, read_shard, row_ids, write_stats)
from pipeline.data.commit import atomic_write_json, remove_temp_files
from pipeline.data.manifest import totals
from pipeline.data.outputs import STATS_SCHEMA, error_results
from pipeline.data.plan import plan_filtered
from pipeline.data.stats_files import read_stats
from pipeline.config import OUTPUT_COLUMNS

TASKS = ["qa", "summarize", "code"]


def make_rows(start, n):
    return {
        "key": [f"k{i}" for i in range(start, start + n)],
        "task": [TASKS[i % 3] for i in range(start, start + n)],
        "text": [f"text number {i}" for i in range(start, start + n)],
        "ref": [i * 10 for i in range(start, start + n)],
    }


@pytest.fixture
def dataset_dir(tmp_path):
    """Three files of 10, 7 and 13 rows, written with small row groups."""
    folder = tmp_path / "data"
    folder.mkdir()
    start = 0
    for i, n in enumerate([10, 7, 13]):
        pq.write_table(pa.table(make_rows(start, n)), folder / f"f{i}.parquet", row_group_size=4)
        start += n
    (folder / "_SUCCESS").write_text("")
    return folder


def read_all(source, shards, columns, **kw):
    return pa.concat_tables([read_shard(source.files, source.file_rows, s, columns, **kw)
                             for s in shards])


@pytest.mark.parametrize("how", ["dir", "glob", "file"])
def test_source_forms(dataset_dir, how):
    path = {"dir": str(dataset_dir), "glob": str(dataset_dir / "f*.parquet"),
            "file": str(dataset_dir / "f1.parquet")}[how]
    source = open_source(path)
    assert source.total_rows == (7 if how == "file" else 30)
    assert "text" in source.schema.names


def test_missing_path_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        open_source(str(tmp_path / "nope.parquet"))
    with pytest.raises(UserError, match="no Parquet"):
        open_source(str(tmp_path / "*.parquet"))


def test_shards_are_row_ranges_covering_everything_once(dataset_dir):
    source = open_source(str(dataset_dir))
    shards = plan_shards(source, rows_per_shard=8)
    assert [(s.start, s.stop) for s in shards] == [(0, 8), (8, 16), (16, 24), (24, 30)]
    table = read_all(source, shards, ["key"])
    # rows come back in dataset order across file and row-group boundaries
    assert table["key"].to_pylist() == [f"k{i}" for i in range(30)]
    assert table["__position__"].to_pylist() == list(range(30))


def test_limit(dataset_dir):
    source = open_source(str(dataset_dir))
    shards = plan_shards(source, rows_per_shard=4, limit=11)
    assert sum(s.num_rows for s in shards) == 11
    assert shards[-1].stop == 11
    assert read_all(source, shards, ["key"])["key"].to_pylist()[-1] == "k10"


def test_task_filter_plans_kept_rows_per_shard(dataset_dir):
    source = open_source(str(dataset_dir))
    shards = plan_shards(source, rows_per_shard=3, task_column="task", tasks=("summarize",))
    expected = [i for i in range(30) if TASKS[i % 3] == "summarize"]
    assert sum(s.num_rows for s in shards) == len(expected)
    assert all(s.num_rows == 3 for s in shards[:-1])
    table = read_all(source, shards, ["key"], task_column="task", tasks=("summarize",))
    assert table["__position__"].to_pylist() == expected
    limited = plan_shards(source, rows_per_shard=3, limit=4, task_column="task",
                          tasks=("summarize",))
    assert sum(s.num_rows for s in limited) == 4


def test_plan_filtered_worked_example():
    import numpy as np
    shards = plan_filtered([np.array([3, 4, 9]), np.array([12, 15])], rows_per_shard=2)
    assert [(s.start, s.stop, s.num_rows) for s in shards] == [(0, 5, 2), (5, 13, 2), (13, 16, 1)]


def test_template_and_ids(dataset_dir):
    source = open_source(str(dataset_dir))
    data = DataConfig(path=str(dataset_dir), template="Summarize:\n{text}\nSummary:",
                      prompt_column=None)
    assert needed_columns(data, ("ref",)) == ["text", "ref"]
    shard = plan_shards(source, rows_per_shard=5)[2]
    table = read_shard(source.files, source.file_rows, shard, needed_columns(data, ()))
    prompts, errors = build_prompts(table, data)
    assert prompts[0] == "Summarize:\ntext number 10\nSummary:"
    assert errors == [None] * 5
    assert row_ids(table, data).to_pylist() == [10, 11, 12, 13, 14]   # dataset positions
    with_ids = DataConfig(path="x", prompt_column="text", id_column="key")
    table = read_shard(source.files, source.file_rows, shard, needed_columns(with_ids, ()))
    assert row_ids(table, with_ids).to_pylist() == [f"k{i}" for i in range(10, 15)]


def test_missing_columns_are_named(dataset_dir):
    source = open_source(str(dataset_dir))
    data = DataConfig(path="x", template="{body} {text}", prompt_column=None)
    with pytest.raises(UserError, match="body"):
        check_columns(source.schema, data, ())
    with pytest.raises(UserError, match="fields must name columns"):
        needed_columns(DataConfig(path="x", template="{}"), ())


def test_bad_rows_get_errors_not_crashes():
    table = pa.table({"text": ["ok", None], "p": ["a", None]})
    prompts, errors = build_prompts(table, DataConfig(path="x", template="T {text}"))
    assert prompts == ["T ok", None] and errors[0] is None and "null" in errors[1]
    prompts, errors = build_prompts(table, DataConfig(path="x", prompt_column="p"))
    assert prompts == ["a", None] and errors[1] is not None


def results(n):
    return [{"generated_text": f"g{i}", "finish_reason": "length", "num_prompt_tokens": 3,
             "num_generated_tokens": 4, "num_drafted_tokens": 6, "num_accepted_tokens": 2,
             "error": None} for i in range(n)]


def test_commit_is_atomic_and_keeps_columns(tmp_path):
    keep = pa.table({"ref": [1, 2]})
    table = output_table(pa.array([5, 6]), ["p5", "p6"], results(2), keep)
    assert tuple(table.column_names) == OUTPUT_COLUMNS + ("ref",)
    stats = [{"shard_id": 3, "task": "default", "num_rows": 2}]
    path = commit_part(tmp_path, 3, table, stats)
    assert path.name == "part-00003.parquet"
    assert os.listdir(tmp_path / "outputs") == ["part-00003.parquet"]  # no temp left
    assert committed_shards(tmp_path) == {3: path}
    assert part_stats(path) == stats
    back = pq.read_table(path)
    assert back["id"].to_pylist() == [5, 6] and back["ref"].to_pylist() == [1, 2]
    assert back["error"].null_count == 2


def test_interrupted_write_is_not_committed(tmp_path):
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / ".part-00000.parquet.tmp-123").write_bytes(b"partial")
    assert committed_shards(tmp_path) == {}
    assert remove_temp_files(tmp_path) == 1
    assert os.listdir(tmp_path / "outputs") == []


def test_error_rows_and_stats_file(tmp_path):
    table = output_table(pa.array([1, 2, 3]), ["a", "b", None], error_results(3, "actor died"))
    assert table["finish_reason"].to_pylist() == ["error"] * 3
    assert table["error"].to_pylist() == ["actor died"] * 3
    rows = [{"shard_id": 1, "task": "t", "num_rows": 3, "gamma": 2, "mean_acceptance_length": 2.0,
             "num_generated_tokens": 10, "acceptance_by_depth": [0.5, 0.25],
             "gamma_candidates": [], "predicted_goodput": [], "gamma_steps": [1, 0, 5]},
            {"shard_id": 0, "task": "t", "num_rows": 1, "gamma": 2, "mean_acceptance_length": 1.0,
             "num_generated_tokens": 5, "gamma_steps": [0, 0, 3]}]
    assert write_stats(tmp_path, rows) == tmp_path / "stats"
    assert sorted(os.listdir(tmp_path / "stats")) == ["shard-00000.parquet", "shard-00001.parquet"]
    back = read_stats(tmp_path)
    assert back.schema.equals(STATS_SCHEMA)
    assert back["shard_id"].to_pylist() == [0, 1]
    t = totals(rows)
    assert t["rows"] == 4 and t["generated_tokens"] == 15
    assert t["mean_acceptance_length"] == pytest.approx(15 / (5 / 1.0 + 10 / 2.0))
    assert t["gamma_histogram"] == {"0": 1, "2": 8}          # verify steps per gamma, not rows


def test_atomic_json(tmp_path):
    atomic_write_json(tmp_path / "m.json", {"a": 1})
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["m.json"]
