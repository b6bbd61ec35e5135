"""output.dir, model.path and data.path on a real S3 API: moto's server on a loopback port, started here.

The run directory's files (parts written by the actors, the stats file and manifest written by
the driver) land in the bucket; a resume against the URI redoes only the missing shard; a
model URI is fetched once into a node-local cache; a node that cannot see the model says
which node and which path.
"""
import json
import os

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from pipeline.config import OUTPUT_COLUMNS, RunConfig, UserError
from pipeline.data import (commit_part, committed_shards, part_stats, read_manifest,
                           read_stats, write_stats)
from pipeline.data.commit import remove_temp_files
from pipeline.data.storage import Store, hydra_dir, open_store
from pipeline.cluster.model_files import ModelNotVisible, cache_dir_for, model_on_node

moto_server = pytest.importorskip("moto.server")
ray = pytest.importorskip("ray")

BUCKET = "specbatch-test"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on 127.0.0.1:<free port> with one bucket; yields a URI maker."""
    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)      # before ray.init: actors inherit the credentials
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    fs = pafs.S3FileSystem(endpoint_override=f"{host}:{port}", scheme="http", region="us-east-1",
                           access_key="testing", secret_key="testing", allow_bucket_creation=True)
    fs.create_dir(BUCKET)
    query = f"?endpoint_override={host}:{port}&scheme=http&region=us-east-1"
    try:
        yield {"fs": fs, "uri": lambda key: f"s3://{BUCKET}/{key}{query}"}
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def results(n):
    return [{"generated_text": f"g{i}", "finish_reason": "length", "num_generated_tokens": 2,
             "error": None} for i in range(n)]


def test_commit_list_and_clean_on_s3(s3):
    from pipeline.data.outputs import output_table

    run = s3["uri"]("unit/run")
    table = output_table(pa.array([1, 2]), ["a", "b"], results(2))
    stats = [{"shard_id": 4, "task": "t", "num_rows": 2, "num_generated_tokens": 4}]
    path = commit_part(run, 4, table, stats)
    assert path == f"{BUCKET}/unit/run/outputs/part-00004.parquet"
    names = [i.base_name for i in s3["fs"].get_file_info(pafs.FileSelector(f"{BUCKET}/unit/run/outputs"))]
    assert names == ["part-00004.parquet"]                     # the temporary key is gone
    assert committed_shards(run) == {4: path}
    assert part_stats(path, s3["fs"]) == stats
    assert pq.read_table(path, filesystem=s3["fs"])["id"].to_pylist() == [1, 2]
    # a leftover of an interrupted write is not a commit, and is cleaned up
    with s3["fs"].open_output_stream(f"{BUCKET}/unit/run/outputs/.part-00005.parquet.tmp-9-ab") as f:
        f.write(b"partial")
    assert set(committed_shards(run)) == {4}
    assert remove_temp_files(run) == 1
    assert read_manifest(run) is None
    assert write_stats(run, stats) == f"{BUCKET}/unit/run/stats"
    assert read_stats(run)["shard_id"].to_pylist() == [r["shard_id"] for r in stats]
    assert hydra_dir(run).startswith(os.path.join("runs", "_hydra", "s3_"))
    assert hydra_dir("file:///tmp/x") == "/tmp/x" and hydra_dir("runs/a") == "runs/a"
    assert open_store(run).root == f"{BUCKET}/unit/run"


def test_model_uri_is_fetched_once_and_missing_models_name_the_node(s3, tmp_path):
    from pipeline.model.tiny import make_tiny_checkpoint

    local = make_tiny_checkpoint(tmp_path / "m", arch="llama", num_mtp_layers=1, seed=0)
    pafs.copy_files(str(local), f"{BUCKET}/models/unit", destination_filesystem=s3["fs"])
    uri = s3["uri"]("models/unit")
    got = model_on_node(uri, "node-A", root=tmp_path / "cache")
    assert got == str(cache_dir_for(uri, tmp_path / "cache"))
    assert sorted(os.listdir(got)) == sorted(os.listdir(local))
    mtime = os.stat(os.path.join(got, "config.json")).st_mtime_ns
    assert model_on_node(uri, "node-A", root=tmp_path / "cache") == got   # cached: not fetched again
    assert os.stat(os.path.join(got, "config.json")).st_mtime_ns == mtime
    for missing in (s3["uri"]("models/none"), str(tmp_path / "nowhere")):
        with pytest.raises(ModelNotVisible, match="node node-B cannot see model.path") as info:
            model_on_node(missing, "node-B", root=tmp_path / "cache")
        assert missing in str(info.value)


@pytest.fixture(scope="module")
def assets(s3, tmp_path_factory):
    from pipeline.model.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("s3assets")
    model = make_tiny_checkpoint(root / "model", arch="llama", num_mtp_layers=1, seed=0)
    pafs.copy_files(str(model), f"{BUCKET}/models/tiny", destination_filesystem=s3["fs"])
    n = 10
    table = pa.table({"id": [f"r{i}" for i in range(n)],
                      "text": [f"the quick brown fox {i}" for i in range(n)]})
    pq.write_table(table, root / "d.parquet")
    for name, part in (("a.parquet", table.slice(0, 6)), ("b.parquet", table.slice(6))):
        pq.write_table(part, f"{BUCKET}/data/{name}", filesystem=s3["fs"], row_group_size=4)
    with s3["fs"].open_output_stream(f"{BUCKET}/data/_SUCCESS") as f:   # not a data file
        f.write(b"")
    return {"model_uri": s3["uri"]("models/tiny"), "data": str(root / "d.parquet"), "rows": n,
            "data_uri": s3["uri"]("data"), "cache": str(root / "cache")}


def test_data_path_uri_lists_and_reads(s3, assets):
    from pipeline.data import open_source, plan_shards, read_shard

    source = open_source(assets["data_uri"])
    assert [f.split("?")[0] for f in source.files] == [f"s3://{BUCKET}/data/a.parquet",
                                                       f"s3://{BUCKET}/data/b.parquet"]
    assert source.file_rows == (6, 4) and source.total_rows == assets["rows"]
    assert open_source(s3["uri"]("data/*.parquet")).files == source.files
    shard = plan_shards(source, 4)[1]                  # rows 4..7 span both files
    table = read_shard(source.files, source.file_rows, shard, ["id"])
    assert table["id"].to_pylist() == ["r4", "r5", "r6", "r7"]
    with pytest.raises(UserError, match="no Parquet files"):
        open_source(s3["uri"]("nothing-here"))


@pytest.fixture(scope="module")
def ray_session(s3, assets):
    os.environ["SPECBATCH_CACHE"] = assets["cache"]      # the actors' model cache (one "node")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield
    ray.shutdown()
    os.environ.pop("SPECBATCH_CACHE", None)


def raw_cfg(assets, output_dir, model_path, resume=False):
    return {"model": {"path": model_path}, "data": {"path": assets["data"], "id_column": "id",
            "template": "Summarize:\n{text}\nSummary:"}, "output": {"dir": output_dir},
            "sampling": {"max_new_tokens": 3}, "spec": {"gamma": 1},
            "shards": {"rows_per_shard": 4}, "engine": {"max_batch_size": 4},
            "cluster": {"num_actors": 2, "cpus_per_actor": 1}, "resume": resume}


def test_run_and_resume_against_s3(s3, assets, ray_session):
    from pipeline.cluster.driver import run_generation

    fs, run = s3["fs"], s3["uri"]("runs/job1")
    raw = raw_cfg(assets, run, assets["model_uri"])
    raw["data"]["path"] = assets["data_uri"]                 # every input on S3 too
    manifest = run_generation(RunConfig.from_dict(raw), raw, progress=False)
    assert manifest["status"] == "finished"
    root = f"{BUCKET}/runs/job1"
    table = ds.dataset(f"{root}/outputs", filesystem=fs, format="parquet").to_table()
    assert sorted(table["id"].to_pylist()) == [f"r{i}" for i in range(assets["rows"])]
    assert tuple(table.column_names) == OUTPUT_COLUMNS and table["error"].null_count == table.num_rows
    stats = read_stats(Store(fs, root, root))
    assert sorted(stats["shard_id"].to_pylist()) == [0, 1, 2]
    stored = json.loads(fs.open_input_stream(f"{root}/manifest.json").read())
    assert stored["status"] == "finished" and stored["totals"]["rows"] == assets["rows"]
    assert [s["file"] for s in stored["shards"]] == [f"outputs/part-0000{i}.parquet" for i in range(3)]
    assert os.listdir(assets["cache"]) and not os.path.exists("s3:")   # fetched to the cache

    # lose shard 1 and leave a half-written temporary: the resume redoes shard 1 only
    fs.delete_file(f"{root}/outputs/part-00001.parquet")
    with fs.open_output_stream(f"{root}/outputs/.part-00001.parquet.tmp-1-dead") as f:
        f.write(b"partial")
    kept = {i: part_stats(f"{root}/outputs/part-0000{i}.parquet", fs) for i in (0, 2)}
    raw = raw_cfg(assets, run, assets["model_uri"], resume=True)
    raw["data"]["path"] = assets["data_uri"]
    manifest = run_generation(RunConfig.from_dict(raw), raw, progress=False)
    assert manifest["status"] == "finished" and manifest["totals"]["rows"] == assets["rows"]
    names = sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(f"{root}/outputs")))
    assert names == [f"part-0000{i}.parquet" for i in range(3)]
    assert {i: part_stats(f"{root}/outputs/part-0000{i}.parquet", fs) for i in (0, 2)} == kept
    table = ds.dataset(f"{root}/outputs", filesystem=fs, format="parquet").to_table()
    assert sorted(table["id"].to_pylist()) == [f"r{i}" for i in range(assets["rows"])]


def test_actor_names_its_node_when_the_model_is_missing(assets, ray_session, tmp_path):
    from pipeline.cluster.driver import run_generation

    missing = str(tmp_path / "no-such-model")
    raw = raw_cfg(assets, str(tmp_path / "run"), missing)
    raw["cluster"]["num_actors"] = 1
    with pytest.raises(UserError) as info:
        run_generation(RunConfig.from_dict(raw), raw, progress=False)
    message = str(info.value)
    assert message.startswith("node ") and "Traceback" not in message   # one line, no Ray wrapper
    assert "cannot see model.path" in message and missing in message
    assert f"node {ray.util.get_node_ip_address()} (node_id {ray.get_runtime_context().get_node_id()})" in message
