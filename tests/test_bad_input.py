"""Bad input: a clear message naming the problem, before Ray starts and before anything is
written to output.dir; bad rows become error rows (or truncated rows) beside good rows."""
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from pipeline.engine.params import SamplingParams
from pipeline.recipes import CONF_DIR
from pipeline.run import register_resolvers, run_recipe
from tests.tiny_models import tiny_checkpoint

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_checkpoint(str(tmp_path_factory.mktemp("ckpt")), arch="llama", num_mtp_layers=1,
                           max_position_embeddings=48)


def composed(model, data, out, *overrides):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=[
            "job.name=t", "job.recipe=generate", f"model.path={model}", f"data.path={data}",
            f"output.dir={out}", "cluster.cpus_per_actor=1", *overrides])


def run(model, data, out, *overrides):
    return run_recipe(composed(model, data, out, *overrides))


def good_table(n=4):
    return pa.table({"prompt": [f"the quick brown fox {i}" for i in range(n)],
                     "text": [f"doc {i}" for i in range(n)], "n": list(range(n))})


def good(path):
    pq.write_table(good_table(), path)


def corrupt(path):
    path.write_bytes(b"this is not a parquet file at all")


def truncated(path):
    pq.write_table(good_table(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


CASES = [   # (name, how to make data.path, overrides, words the message must hold)
    ("missing", None, [], ["nowhere.parquet", "does not exist"]),
    ("corrupt", corrupt, [], ["d.parquet", "not a readable Parquet file"]),
    ("truncated", truncated, [], ["d.parquet", "not a readable Parquet file"]),
    ("missing column", good, ["data.prompt_column=question"],
     ["['question']", "its columns are ['prompt', 'text', 'n']"]),
    ("non-string prompt", good, ["data.prompt_column=n"],
     ["data.prompt_column 'n' holds int64, not strings", "data.template='{n}'"]),
    ("template column", good, ["data.template='Q: {question} {text}'"],
     ["['question']", "data.template", "its columns are ['prompt', 'text', 'n']"]),
    ("negative gamma", good, ["spec.gamma=-1"], ["spec.gamma", "-1"]),
    ("zero batch", good, ["engine.max_batch_size=0"], ["engine.max_batch_size", "> 0"]),
    ("negative temperature", good, ["sampling.temperature=-0.5"],
     ["sampling.temperature", ">= 0"]),
    ("resume and overwrite", good, ["resume=true", "overwrite=true"], ["pass one"]),
]


@pytest.mark.parametrize("name,make,overrides,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_message_and_nothing_is_written(model, tmp_path, capsys, name, make,
                                                       overrides, words):
    data = tmp_path / ("nowhere.parquet" if make is None else "d.parquet")
    if make is not None:
        make(data)
    out = tmp_path / "run"
    assert run(model, data, out, *overrides) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    for word in words:
        assert word in err
    assert not ray.is_initialized()                       # refused before Ray started
    written = [p for p in out.rglob("*") if ".hydra" not in p.parts] if out.exists() else []
    assert written == []                                  # no manifest, outputs or stats


NOBODY = 65534


def exit_code_as_nobody(fn, *args) -> tuple[int, str]:
    """fn(*args) in a forked child running as user nobody (root reads files whatever their
    mode, and the tests here run as root); its return value and what it wrote to stderr.
    Everything fn needs from the virtual environment must be loaded before the call: CI's
    venv lives in a mktemp folder that only root can enter."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                          # the child: never returns
        code = 99
        try:
            os.close(r)
            sys.stderr = os.fdopen(w, "w", buffering=1)       # pytest captures sys.stderr
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = int(fn(*args))
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        err = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), err


def test_unreadable_file_is_named(tmp_path, capsys):
    public = Path(tempfile.mkdtemp(prefix="unreadable-", dir="/tmp"))   # nobody can reach it
    try:
        public.chmod(0o755)
        model = tiny_checkpoint(str(public), arch="llama", num_mtp_layers=1, max_position_embeddings=48)
        data = public / "locked.parquet"
        pq.write_table(good_table(), data)
        data.chmod(0)
        if os.geteuid() == 0:
            cfg = composed(model, data, public / "run")       # Hydra reads its files as root
            code, err = exit_code_as_nobody(run_recipe, cfg)
        else:
            code, err = run(model, data, public / "run"), capsys.readouterr().err
        assert code == 1, err
        assert "locked.parquet" in err and "Traceback" not in err
        assert not (public / "run").exists()
    finally:
        shutil.rmtree(public, ignore_errors=True)


def test_the_corrupt_file_of_a_folder_is_named(model, tmp_path, capsys):
    (tmp_path / "in").mkdir()
    pq.write_table(good_table(), tmp_path / "in" / "a.parquet")
    (tmp_path / "in" / "b.parquet").write_bytes(b"\0" * 64)
    assert run(model, tmp_path / "in", tmp_path / "run") == 1
    err = capsys.readouterr().err
    assert "b.parquet" in err and "Traceback" not in err


@pytest.mark.parametrize("truncate", [False, True])
def test_null_empty_and_long_prompts_are_error_rows_beside_good_rows(model, tmp_path, truncate):
    from pipeline.data import open_source, plan_shards
    from pipeline.config import DataConfig
    from pipeline.cluster.actor import load_engine
    from pipeline.config import EngineConfig, ModelConfig
    from pipeline.cluster.worker import ShardTask, process_shard

    long = "the quick brown fox jumps over the lazy dog " * 20      # far past 48 tokens
    prompts = ["def add(a, b):", None, "", long, "the quick brown"]
    pq.write_table(pa.table({"prompt": pa.array(prompts, pa.string())}), tmp_path / "d.parquet")
    source = open_source(str(tmp_path / "d.parquet"))
    shard = plan_shards(source, 8)[0]
    engine = load_engine(ModelConfig(path=model, device="cpu"), EngineConfig(max_batch_size=2))
    task = ShardTask(shard, 1, source.files, source.file_rows, DataConfig(path="x"), (),
                     SamplingParams(max_new_tokens=4, truncate_prompt=truncate), gamma=1)
    table = process_shard(engine, task, {"device": "cpu", "threads": 1}).table
    assert table["id"].to_pylist() == [0, 1, 2, 3, 4]
    rows = table.to_pylist()
    assert "is None" in rows[1]["error"] and "empty prompt" in rows[2]["error"]
    assert all(r["finish_reason"] == "error" for r in rows[1:3])
    for r in (rows[0], rows[4]):                          # good rows complete
        assert r["error"] is None and r["finish_reason"] in ("stop", "length")
        assert r["num_generated_tokens"] >= 1
    if truncate:   # the long prompt keeps its last tokens and is generated too
        assert rows[3]["error"] is None and 0 < rows[3]["num_prompt_tokens"] < 48
    else:
        assert rows[3]["finish_reason"] == "error" and "context is 48" in rows[3]["error"]


def test_a_shard_whose_rows_cannot_be_read_is_a_message_naming_the_file(tmp_path):
    """Footer intact, a data page broken: planning succeeds, reading the shard is a UserError
    (which stops the run: pipeline/cluster/pool.py) naming the rows and the file."""
    from pipeline.config import DataConfig, UserError
    from pipeline.data import open_source, plan_shards
    from pipeline.cluster.worker import ShardTask, read_task_rows

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": [f"row {i} " * 50 for i in range(200)]}), path,
                   compression="none", row_group_size=100)
    source = open_source(str(path))
    data = bytearray(path.read_bytes())
    first_group = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = first_group.data_page_offset
    data[start:start + 64] = b"\xff" * 64                  # the second row group's page header
    path.write_bytes(bytes(data))
    shards = plan_shards(source, 100)
    task = ShardTask(shards[1], 1, source.files, source.file_rows, DataConfig(path="x"), (),
                     SamplingParams(), gamma=0)
    with pytest.raises(UserError, match=r"cannot read rows \[100, 200\).*d\.parquet"):
        read_task_rows(task)
    assert read_task_rows(ShardTask(shards[0], 1, source.files, source.file_rows,
                                    DataConfig(path="x"), (), SamplingParams(), gamma=0)).num_rows == 100
