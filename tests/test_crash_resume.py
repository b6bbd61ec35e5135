"""The whole run killed (SIGKILL of the driver, its local Ray and the actors) and run again with
resume=true: it finishes, redoes no committed shard, and yields every id exactly once. Resuming
with other settings is refused naming them; overwrite=true starts over."""
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline.config import RunConfig
from pipeline.data.outputs import error_results, output_table
from pipeline.data.record import open_run
from pipeline.data.stats_files import read_stats
from pipeline.recipes import CONF_DIR, REPO_ROOT
from pipeline.run import register_resolvers, run_recipe
from tests.tiny_models import tiny_checkpoint

pytest.importorskip("ray")
NUM_ROWS, PER_SHARD = 72, 2


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    model = tiny_checkpoint(str(root), arch="llama", num_mtp_layers=1, hidden_size=128, num_layers=4)
    pq.write_table(pa.table({"id": [f"r{i:03d}" for i in range(NUM_ROWS)],
                             "text": [f"the quick brown fox {i}" for i in range(NUM_ROWS)]}),
                   root / "d.parquet", row_group_size=10)
    return [f"model.path={model}", f"data.path={root / 'd.parquet'}", f"output.dir={root / 'run'}",
            "+job=summarize", "data.task_column=null", "data.tasks=null", "output.keep_columns=[]",
            "data.template='Summarize: {text}'",
            "data.id_column=id", f"shards.rows_per_shard={PER_SHARD}", "cluster.num_actors=1",
            "cluster.cpus_per_actor=1", "sampling.max_new_tokens=24", "spec.gamma=1",
            "engine.max_batch_size=2"], root / "run"


def command(overrides):
    return [sys.executable, "-m", "pipeline.run", *overrides]


def parts(run_dir):
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in (run_dir / "outputs").glob("part-*.parquet")}


def descendants(pid):
    """Every live process below `pid`, from /proc (Linux)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_everything(proc):
    """SIGKILL the driver's process group and every process below it (Ray's own processes and
    the actors may sit in sessions of their own)."""
    family = descendants(proc.pid)
    for pid in [-proc.pid] + family:          # -pid: the whole process group
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in family):
        assert time.monotonic() < deadline, [p for p in family if alive(p)]
        time.sleep(0.1)


def test_killed_run_resumes_without_redoing_committed_shards(job, tmp_path):
    overrides, run_dir = job
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen(command(overrides), cwd=REPO_ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while len(parts(run_dir)) < 3:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "no shard committed in time"
            time.sleep(0.05)
    finally:
        kill_everything(proc)
    before = parts(run_dir)
    num_shards = NUM_ROWS // PER_SHARD
    assert 3 <= len(before) < num_shards, "the run ended before it was killed"
    assert json.loads((run_dir / "manifest.json").read_text())["status"] == "running"

    done = subprocess.run(command(overrides + ["resume=true"]), cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    after = parts(run_dir)
    assert len(after) == num_shards
    assert {name: after[name] for name in before} == before      # same inode, same mtime
    table = ds.dataset(str(run_dir / "outputs"), format="parquet").to_table()
    assert sorted(table["id"].to_pylist()) == [f"r{i:03d}" for i in range(NUM_ROWS)]
    assert table["error"].null_count == NUM_ROWS
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "finished" and manifest["resumed_at"]
    assert manifest["totals"]["rows"] == NUM_ROWS
    assert not [p for p in run_dir.rglob("*.tmp-*")]                # no half-written file left
    stats = read_stats(run_dir)
    assert sorted(stats["shard_id"].to_pylist()) == list(range(num_shards))


def test_killed_inside_a_part_write_resumes_with_no_partial_part(job, tmp_path):
    """Fault injection (pipeline/data/faults.py): the actor writing shard 4's part stops half-way
    through its temporary file and the whole run is killed there. No reader ever sees a part
    that is not complete, and the resumed run yields every id exactly once."""
    overrides, _ = job
    run_dir = tmp_path / "run"
    mine = [o for o in overrides if not o.startswith("output.dir")] + [f"output.dir={run_dir}"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", SPECBATCH_FAULT_STALL_WRITE="part-00004.parquet")
    proc = subprocess.Popen(command(mine), cwd=REPO_ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not [p for p in (run_dir / "outputs").glob(".part-00004.parquet.tmp-*") if p.stat().st_size]:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline, "the write of part 4 never started"
            time.sleep(0.05)
    finally:
        kill_everything(proc)
    partial = list((run_dir / "outputs").glob(".part-00004.parquet.tmp-*"))
    assert len(partial) == 1 and not (run_dir / "outputs" / "part-00004.parquet").exists()
    with pytest.raises(Exception):
        pq.read_table(partial[0])                                     # it really is half a file
    before = parts(run_dir)
    assert set(before) == {f"part-{i:05d}.parquet" for i in range(4)}
    seen = ds.dataset(str(run_dir / "outputs"), format="parquet").to_table()   # what a reader sees
    assert sorted(seen["id"].to_pylist()) == [f"r{i:03d}" for i in range(4 * PER_SHARD)]

    env.pop("SPECBATCH_FAULT_STALL_WRITE")
    done = subprocess.run(command(mine + ["resume=true"]), cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    after = parts(run_dir)
    assert len(after) == NUM_ROWS // PER_SHARD and {n: after[n] for n in before} == before
    table = ds.dataset(str(run_dir / "outputs"), format="parquet").to_table()
    assert sorted(table["id"].to_pylist()) == [f"r{i:03d}" for i in range(NUM_ROWS)]   # each once
    assert not list(run_dir.rglob("*.tmp-*"))
    assert sorted(read_stats(run_dir)["shard_id"].to_pylist()) == list(range(NUM_ROWS // PER_SHARD))


def run_in_process(overrides):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return run_recipe(compose(config_name="config", overrides=overrides))


@pytest.mark.parametrize("change,said", [
    ("sampling.seed=3", "sampling.seed: 0 -> 3"),
    ("sampling.temperature=0.7", "sampling.temperature: 0.0 -> 0.7"),
    ("data.template='Q: {text}'", "data.template: 'Summarize: {text}' -> 'Q: {text}'"),
    ("model.path=OTHER", "model.path: "),
])
def test_resume_with_other_settings_is_refused_naming_them(job, tmp_path, capsys, change, said):
    overrides, _ = job
    run_dir = tmp_path / "run"
    small = [o for o in overrides if not o.startswith("output.dir")] + [f"output.dir={run_dir}"]
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        raw = OmegaConf.to_container(compose(config_name="config", overrides=small), resolve=True)
    record = open_run(RunConfig.from_dict(raw), raw)     # a run that committed one shard
    shard = record.plan[0]
    ids = pa.array([f"r{i:03d}" for i in range(shard.start, shard.stop)])
    table = output_table(ids, ["p"] * shard.num_rows, error_results(shard.num_rows, "x"))
    record.commit(shard, table, [{"shard_id": 0, "task": "default", "num_rows": shard.num_rows}])
    before = parts(run_dir)
    if change.startswith("model.path"):
        other = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1)
        change = f"model.path={other}"
    assert run_in_process(small + ["resume=true", change]) == 1
    err = capsys.readouterr().err
    assert "config differs" in err and said in err and "overwrite=true" in err
    assert parts(run_dir) == before                      # nothing touched
    assert run_in_process(small + [change]) == 1         # without resume: refused too
    assert "resume=true" in capsys.readouterr().err and parts(run_dir) == before
    raw = raw | {"overwrite": True}                       # overwrite=true starts over
    record = open_run(RunConfig.from_dict(raw), raw)
    assert parts(run_dir) == {} and len(record.pending()) == len(record.plan)
