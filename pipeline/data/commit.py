"""Atomic commits into the run directory.

A shard is committed when `outputs/part-NNNNN.parquet` exists: it is written under a hidden
temporary name in the same folder and renamed, so readers never see a partial file. The
shard's stats rows travel in the part's schema metadata too, so `stats/shards.parquet` can
always be rebuilt from the committed parts.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

OUTPUTS = "outputs"
STATS = "stats"
MANIFEST = "manifest.json"
STATS_KEY = b"specbatch.shard_stats"
_PART = re.compile(r"^part-(\d{5,})\.parquet$")


def part_path(run_dir: Path, shard_id: int) -> Path:
    return Path(run_dir) / OUTPUTS / f"part-{shard_id:05d}.parquet"


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    tmp.write_bytes(data)
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, json.dumps(obj, indent=2, sort_keys=False, default=str).encode())


def atomic_write_table(path: Path, table: pa.Table) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def commit_part(run_dir: Path, shard_id: int, table: pa.Table,
                stats_rows: Sequence[dict]) -> Path:
    """Write a shard's output rows (and its stats in the metadata) atomically."""
    meta = dict(table.schema.metadata or {})
    meta[STATS_KEY] = json.dumps(list(stats_rows), default=str).encode()
    path = part_path(run_dir, shard_id)
    atomic_write_table(path, table.replace_schema_metadata(meta))
    return path


def committed_shards(run_dir: Path) -> dict[int, Path]:
    """shard_id -> part file, for every committed part."""
    folder = Path(run_dir) / OUTPUTS
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        m = _PART.match(path.name)
        if m:
            found[int(m.group(1))] = path
    return dict(sorted(found.items()))


def part_stats(path: Path) -> list[dict]:
    """The stats rows stored with a committed part (metadata only; rows are not read)."""
    meta = pq.read_schema(path).metadata or {}
    return json.loads(meta[STATS_KEY]) if STATS_KEY in meta else []


def remove_temp_files(run_dir: Path) -> int:
    """Delete leftovers of interrupted writes; returns how many."""
    removed = 0
    for folder in (Path(run_dir), Path(run_dir) / OUTPUTS, Path(run_dir) / STATS):
        if folder.is_dir():
            for path in folder.glob(".*.tmp-*"):
                path.unlink(missing_ok=True)
                removed += 1
    return removed
