"""`stats/`: one Parquet file per committed shard, read as one dataset.

`stats/shard-NNNNN.parquet` holds the stats rows of shard NNNNN (one per task in it), written
atomically once, when the shard commits; nothing already there is rewritten, so committing a
shard costs the same at any run size. `read_stats(run_dir)` reads the folder as one table
(hidden temporary files are skipped by Parquet dataset discovery). Runs written before this
layout kept every row in `stats/shards.parquet`; `remove_legacy_stats` deletes that file when
such a run is resumed, and the rows come back from the parts' metadata (commit.py).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.dataset as ds

from pipeline.data.commit import STATS, atomic_write_table, numbered_files
from pipeline.data.outputs import STATS_SCHEMA, stats_table
from pipeline.data.storage import Where, delete_files, list_names, open_store

LEGACY_STATS = "shards.parquet"
_STATS_FILE = re.compile(r"^shard-(\d{5,})\.parquet$")


def stats_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}.parquet"


def write_shard_stats(run_dir: Where, shard_id: int, rows: Sequence[dict]) -> Path | str:
    """Write one shard's stats rows to stats/shard-NNNNN.parquet atomically."""
    store = open_store(run_dir)
    path = store.path(STATS, stats_name(shard_id))
    ordered = sorted(rows, key=lambda r: str(r.get("task")))
    atomic_write_table(path, stats_table(ordered), store.fs)
    return store.show(path)


def write_stats(run_dir: Where, rows: Sequence[dict]) -> Path | str:
    """Write the stats files of the shards `rows` belong to (one file per shard); returns the
    stats folder."""
    by_shard: dict[int, list[dict]] = {}
    for r in rows:
        by_shard.setdefault(int(r["shard_id"]), []).append(r)
    for shard_id, shard_rows in by_shard.items():
        write_shard_stats(run_dir, shard_id, shard_rows)
    store = open_store(run_dir)
    return store.show(store.path(STATS))


def stats_files(run_dir: Where) -> dict[int, Path | str]:
    """shard_id -> stats file, for every shard's stats file in stats/."""
    return numbered_files(run_dir, STATS, _STATS_FILE)


def read_stats(run_dir: Where) -> pa.Table:
    """Every shard's stats rows as one table, ordered by shard and task (empty when none)."""
    store = open_store(run_dir)
    names = [n for n in list_names(store.fs, store.path(STATS))
             if _STATS_FILE.match(n) or n == LEGACY_STATS]
    if not names:
        return STATS_SCHEMA.empty_table()
    files = [store.path(STATS, n) for n in names]     # the schema of this version, columns
    table = ds.dataset(files, schema=STATS_SCHEMA, format="parquet",   # missing in older files null
                       filesystem=store.fs).to_table()
    if table.num_rows == 0:
        return table
    return table.sort_by([("shard_id", "ascending"), ("task", "ascending")])


def remove_stats(run_dir: Where, shard_ids: Sequence[int]) -> int:
    """Delete the stats files of these shards; returns how many were there."""
    store = open_store(run_dir)
    return delete_files(store.fs, [store.path(STATS, stats_name(i)) for i in shard_ids])


def remove_legacy_stats(run_dir: Where) -> bool:
    """Delete stats/shards.parquet (the single-file layout); True when it was there."""
    store = open_store(run_dir)
    return delete_files(store.fs, [store.path(STATS, LEGACY_STATS)]) > 0
