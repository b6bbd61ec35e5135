"""Run directories for the dashboard tests, written by the real writers: `open_run` plans the
run and writes the manifest, `process_shard` runs the real engine on a tiny checkpoint,
`failed_shard_result` is what the driver commits after the last attempt, and `RunRecord.commit`
/ `save` write the parts, the stats/ files and manifest.json.

- empty: planned, nothing committed yet (a run that has just started);
- one: one shard of two tasks, gamma auto, finished;
- failed: two shards, the second given up after 3 attempts (every row carries the error).
Built once per test process (a few seconds) and shared by the dashboard test modules.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import RunConfig
from pipeline.data.record import open_run
from pipeline.cluster.worker import ShardTask, failed_shard_result, process_shard

INFO = {"device": "cpu", "actor_id": "1f2e3d4c" + "0" * 24, "node_id": "n" * 20, "threads": 1}
FAILURE = "actor died 3 times (last: ActorDiedError: the worker process exited)"


def _config(root: Path, model: Path, name: str, rows_per_shard: int) -> tuple[RunConfig, dict]:
    raw = {"model": {"path": str(model)},
           "data": {"path": str(root / "data"), "template": "Summarize: {text}\nSummary:",
                    "id_column": "id", "task_column": "task"},
           "output": {"dir": str(root / name)}, "shards": {"rows_per_shard": rows_per_shard},
           "sampling": {"max_new_tokens": 8}, "spec": {"gamma": "auto", "gamma_max": 2},
           "engine": {"max_batch_size": 4}}
    return RunConfig.from_dict(raw), raw


def _task(cfg: RunConfig, record, shard, attempt: int) -> ShardTask:
    record.attempts[shard.shard_id] = attempt
    return ShardTask(shard=shard, attempt=attempt, files=record.source.files,
                     file_rows=record.source.file_rows, data=cfg.data, keep_columns=(),
                     sampling=cfg.sampling, gamma=cfg.spec.gamma, gamma_max=cfg.spec.gamma_max)


@lru_cache(maxsize=1)
def make_runs() -> dict[str, Path]:
    from pipeline.engine import Engine
    from pipeline.model.tiny import make_tiny_checkpoint

    root = Path(tempfile.mkdtemp(prefix="dashboard-runs-"))
    atexit.register(shutil.rmtree, root, True)
    model = make_tiny_checkpoint(root / "model", arch="llama", num_mtp_layers=2, seed=0)
    (root / "data").mkdir()
    n = 10
    pq.write_table(pa.table({"id": [f"doc-{i}" for i in range(n)],
                             "task": ["summarize", "qa"] * (n // 2),
                             "text": [f"the quick brown fox {i} " * (1 + i % 3) for i in range(n)]}),
                   root / "data" / "part.parquet")
    engine = Engine.from_pretrained(str(model), device="cpu", max_batch_size=4)
    runs = {}

    cfg, raw = _config(root, model, "empty", 5)
    open_run(cfg, raw).save("running")
    runs["empty"] = root / "empty"

    cfg, raw = _config(root, model, "one", n)
    record = open_run(cfg, raw)
    shard = record.plan[0]
    result = process_shard(engine, _task(cfg, record, shard, 1), INFO, {})
    record.commit(shard, result.table, result.stats_rows)
    record.save("finished")
    runs["one"] = root / "one"

    cfg, raw = _config(root, model, "failed", 5)
    record = open_run(cfg, raw)
    good, bad = record.plan
    result = process_shard(engine, _task(cfg, record, good, 1), INFO, {})
    record.commit(good, result.table, result.stats_rows)
    result = failed_shard_result(_task(cfg, record, bad, 3), FAILURE)
    record.commit(bad, result.table, result.stats_rows)
    record.save("finished")
    runs["failed"] = root / "failed"
    return runs
