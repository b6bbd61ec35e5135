"""`manifest.json`: resolved config and hash, package versions, status, totals, shard list.

Rewritten atomically each time a shard commits, so a run in progress can be read.
"""
from __future__ import annotations

import json
import platform
import time
from collections import Counter
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

from pipeline.data.commit import MANIFEST, atomic_write_json
from pipeline.data.storage import Where, open_store, read_bytes
from pipeline.data.plan import Shard

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
    rows = sum(r["num_rows"] for r in stats_rows)
    generated = sum(r.get("num_generated_tokens") or 0 for r in stats_rows)
    steps = sum((r.get("num_generated_tokens") or 0) / r["mean_acceptance_length"]
                for r in stats_rows if r.get("mean_acceptance_length"))
    gamma_steps: Counter = Counter()
    for r in stats_rows:
        for g, n in enumerate(r.get("gamma_steps") or ()):
            if n:
                gamma_steps[g] += n
    return {
        "rows": rows,
        "rows_with_error": sum(r.get("num_errors") or 0 for r in stats_rows),
        "generated_tokens": generated,
        "tokens_per_s": session_tokens / session_wall_s if session_wall_s > 0 else None,
        "mean_acceptance_length": generated / steps if steps > 0 else None,
        "gamma_histogram": {str(g): n for g, n in sorted(gamma_steps.items())},  # gamma -> verify steps
    }


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


def write_manifest(run_dir: Where, manifest: dict) -> None:
    manifest["updated_at"] = now_iso()
    store = open_store(run_dir)
    atomic_write_json(store.path(MANIFEST), manifest, store.fs)


def read_manifest(run_dir: Where) -> dict | None:
    store = open_store(run_dir)
    data = read_bytes(store.fs, store.path(MANIFEST))
    return None if data is None else json.loads(data)
