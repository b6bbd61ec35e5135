"""`manifest.json`: resolved config and hash, package versions, status, totals, shard list.

Rewritten atomically each time a shard commits, so a run in progress can be read; while the
run goes on it holds totals and progress counts (a size that does not grow with the run), and
the per-shard list is added when the run stops (record.py).
"""
from __future__ import annotations

import hashlib
import json
import platform
import time
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

from pipeline.data.commit import MANIFEST, atomic_write_json
from pipeline.data.storage import Where, open_store, read_bytes
from pipeline.data.plan import Shard
from pipeline.data.totals import RunTotals

_PACKAGES = ("specbatch", "torch", "transformers", "tokenizers", "safetensors", "pyarrow",
             "ray", "hydra-core", "numpy")


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def totals(stats_rows: Sequence[dict], session_tokens: int = 0,
           session_wall_s: float = 0.0) -> dict[str, Any]:
    """Run totals from the committed shards' stats rows.

    mean_acceptance_length is emitted tokens over verify steps, pooled across shards (each
    shard's steps are its generated tokens / its mean acceptance length). tokens_per_s is the
    throughput of this driver session (a resumed run counts only what it generated itself).
    """
    t = RunTotals()
    t.observe(stats_rows)
    return t.to_dict(session_tokens, session_wall_s)


def shard_entries(plan: Sequence[Shard], committed: dict[int, Path | str],
                  attempts: dict[int, int]) -> list[dict]:
    entries = []
    for shard in plan:
        status = "committed" if shard.shard_id in committed else "pending"
        entry = shard.to_dict() | {"status": status, "attempts": attempts.get(shard.shard_id, 0)}
        if shard.shard_id in committed:
            entry["file"] = f"outputs/{PurePosixPath(str(committed[shard.shard_id])).name}"
        entries.append(entry)
    return entries


def plan_hash(plan: Sequence[Shard]) -> str:
    """Short hash of the shard plan (every shard's row range): a resume must match it."""
    h = hashlib.sha256()
    for s in plan:
        h.update(f"{s.shard_id},{s.start},{s.stop},{s.num_rows};".encode())
    return h.hexdigest()[:16]


def write_manifest(run_dir: Where, manifest: dict) -> None:
    manifest["updated_at"] = now_iso()
    store = open_store(run_dir)
    atomic_write_json(store.path(MANIFEST), manifest, store.fs)


def read_manifest(run_dir: Where) -> dict | None:
    store = open_store(run_dir)
    data = read_bytes(store.fs, store.path(MANIFEST))
    return None if data is None else json.loads(data)
