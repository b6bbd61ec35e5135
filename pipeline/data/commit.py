"""Atomic commits into the run directory (a local path or a URI; see storage.py).

A shard is committed when `outputs/part-NNNNN.parquet` exists: it is written under a hidden
temporary name in the same folder and moved to its final name, so readers never see a partial
file (on an object store the move is copy + delete, and the final key appears only complete).
The shard's stats rows travel in the part's schema metadata too, so its `stats/` file
(stats_files.py) can always be rebuilt from the committed parts.

Paths handed back are `Path`s for a local run directory and filesystem paths
('bucket/prefix/outputs/part-00001.parquet') for a remote one.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.data.storage import (Where, delete_files, locate, list_names, open_store, remove_temp,
                                   write_bytes_atomic, write_table_atomic)

OUTPUTS = "outputs"
STATS = "stats"
MANIFEST = "manifest.json"
STATS_KEY = b"specbatch.shard_stats"
_PART = re.compile(r"^part-(\d{5,})\.parquet$")
_STATS = re.compile(r"^(shard-\d{5,}|shards)\.parquet$")    # per-shard stats; the old single file


def part_name(shard_id: int) -> str:
    return f"part-{shard_id:05d}.parquet"


def atomic_write_bytes(path: str | Path, data: bytes, fs: pafs.FileSystem | None = None) -> None:
    write_bytes_atomic(*locate(path, fs), data)


def atomic_write_json(path: str | Path, obj: Any, fs: pafs.FileSystem | None = None) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=False, default=str).encode(), fs)


def atomic_write_table(path: str | Path, table: pa.Table, fs: pafs.FileSystem | None = None) -> None:
    write_table_atomic(*locate(path, fs), table)


def commit_part(run_dir: Where, shard_id: int, table: pa.Table,
                stats_rows: Sequence[dict]) -> Path | str:
    """Write a shard's output rows (and its stats in the metadata) atomically."""
    store = open_store(run_dir)
    meta = dict(table.schema.metadata or {})
    meta[STATS_KEY] = json.dumps(list(stats_rows), default=str).encode()
    path = store.path(OUTPUTS, part_name(shard_id))
    write_table_atomic(store.fs, path, table.replace_schema_metadata(meta))
    return store.show(path)


def committed_shards(run_dir: Where) -> dict[int, Path | str]:
    """shard_id -> part file, for every committed part."""
    return numbered_files(run_dir, OUTPUTS, _PART)


def numbered_files(run_dir: Where, subdir: str, pattern: re.Pattern) -> dict[int, Path | str]:
    """shard_id -> file, for the files in run_dir/subdir whose name `pattern` matches (group 1:
    the shard id), in shard order."""
    store = open_store(run_dir)
    folder = store.path(subdir)
    found = {}
    for name in list_names(store.fs, folder):
        m = pattern.match(name)
        if m:
            found[int(m.group(1))] = store.show(f"{folder}/{name}")
    return dict(sorted(found.items()))


def part_stats(path: str | Path, fs: pafs.FileSystem | None = None) -> list[dict]:
    """The stats rows stored with a committed part (metadata only; rows are not read)."""
    fs, where = locate(path, fs)
    meta = pq.read_schema(where, filesystem=fs).metadata or {}
    return json.loads(meta[STATS_KEY]) if STATS_KEY in meta else []


def clear_run(run_dir: Where) -> int:
    """Delete what a run wrote into `run_dir` (parts, stats, manifest, report; `overwrite=true`);
    returns how many files. Anything else there (Hydra's .hydra/, the user's files) stays."""
    store = open_store(run_dir)
    removed = remove_temp_files(store)
    doomed = [f"{store.path(OUTPUTS)}/{part_name(i)}" for i in committed_shards(store)]
    doomed += [f"{store.path(STATS)}/{name}" for name in list_names(store.fs, store.path(STATS))
               if _STATS.match(name)]
    doomed += [store.path(MANIFEST), store.path("report.html")]
    return removed + delete_files(store.fs, doomed)


def remove_temp_files(run_dir: Where) -> int:
    """Delete leftovers of interrupted writes; returns how many."""
    store = open_store(run_dir)
    return sum(remove_temp(store.fs, folder)
               for folder in (store.root, store.path(OUTPUTS), store.path(STATS)))
