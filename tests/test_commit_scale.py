"""A commit costs the same at any run size: it writes the shard's own stats rows (not every
shard's), a manifest whose size does not grow with the committed shards, and the driver keeps
a bounded amount per shard (running totals, not the stats rows with their cost samples).
Counted in rows and bytes written, not timed."""
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq

import pipeline.data.commit as commit_module    # the driver writes through its names
from pipeline.config import RunConfig
from pipeline.data.commit import commit_part
from pipeline.data.outputs import error_results, output_table
from pipeline.data.record import open_run
from pipeline.data.stats_files import read_stats
from benchmarks.commit_scale import stats_row

SHARDS = 400


def test_commit_writes_do_not_grow_with_committed_shards(tmp_path, monkeypatch):
    pq.write_table(pa.table({"prompt": [f"row {i}" for i in range(SHARDS)]}), tmp_path / "d.parquet")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    raw = {"model": {"path": str(tmp_path / "model")}, "data": {"path": str(tmp_path / "d.parquet")},
           "output": {"dir": str(tmp_path / "run")}, "shards": {"rows_per_shard": 1}, "spec": {"gamma": 0}}
    record = open_run(RunConfig.from_dict(raw), raw)
    table = output_table(pa.array([0]), ["p"], error_results(1, "x"))
    for shard in record.plan:                 # the actors' part writes, before anything is counted
        commit_part(record.store, shard.shard_id, table, [stats_row(shard.shard_id)])

    written = []                              # (file name, rows or bytes) per driver write
    real_table, real_bytes = commit_module.write_table_atomic, commit_module.write_bytes_atomic
    monkeypatch.setattr(commit_module, "write_table_atomic",
                        lambda fs, path, t: (written.append((path.rsplit("/", 1)[1], t.num_rows)),
                                             real_table(fs, path, t))[1])
    monkeypatch.setattr(commit_module, "write_bytes_atomic",
                        lambda fs, path, data: (written.append((path.rsplit("/", 1)[1], len(data))),
                                                real_bytes(fs, path, data))[1])
    tracemalloc.start()
    held = {}
    for shard in record.plan:
        written.clear()
        record.mark_committed(shard, 1, [stats_row(shard.shard_id)])
        n = shard.shard_id + 1
        stats_writes = [w for w in written if w[0].startswith("shard-")]
        manifest = [size for name, size in written if name == "manifest.json"]
        assert stats_writes == [(f"shard-{shard.shard_id:05d}.parquet", 1)], written   # its own row only
        assert len(manifest) == 1 and len(written) == 2
        held[n] = (tracemalloc.get_traced_memory()[0], manifest[0])
    tracemalloc.stop()
    (heap_50, manifest_50), (heap_400, manifest_400) = held[50], held[SHARDS]
    assert abs(manifest_400 - manifest_50) < 64, (manifest_50, manifest_400)     # digits of counts
    # 350 more shards, each with 64 x 5 cost samples (~10 kB as Python floats): the driver keeps
    # well under 1 kB per shard
    assert heap_400 - heap_50 < 350 * 1000, (heap_50, heap_400)
    record.save("finished")
    assert read_stats(record.store)["shard_id"].to_pylist() == list(range(SHARDS))
