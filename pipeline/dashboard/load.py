"""A run directory as the dashboard reads it: manifest.json and the stats/ folder.

The manifest is rewritten and each shard's stats file written atomically as shards commit, so
both can be read while a run is in progress; either may be missing (a run that has not committed anything yet) and the report still renders.
The run directory may be a local path or a URI (pipeline.data.storage), as `output.dir` may.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.data.commit import MANIFEST, STATS
from pipeline.data.stats_files import read_stats
from pipeline.data.storage import Store, open_store, read_bytes

STATS_FILE = Path(STATS)     # the folder, read as one Parquet dataset


@dataclass
class RunView:
    run_dir: Path | str
    manifest: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)   # stats rows, one per shard x task
    problems: list[str] = field(default_factory=list)          # what could not be read

    @property
    def status(self) -> str:
        return str(self.manifest.get("status") or "unknown")

    @property
    def totals(self) -> dict[str, Any]:
        return dict(self.manifest.get("totals") or {})

    @property
    def shard_entries(self) -> list[dict[str, Any]]:
        return list(self.manifest.get("shards") or [])


def _clean(value: Any) -> Any:
    """NaN -> None, recursively (JSON and plotting both prefer null)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def read_stats_rows(store: Store) -> list[dict[str, Any]]:
    table = read_stats(store)
    return [{k: _clean(v) for k, v in row.items()} for row in table.to_pylist()]


def load_run(run_dir: str | Path) -> RunView:
    """Read what the run directory holds now; unreadable parts are noted, never raised."""
    store = open_store(run_dir)
    view = RunView(Path(store.root) if store.is_local else store.uri)
    try:
        data = read_bytes(store.fs, store.path(MANIFEST))
        if data is None:
            view.problems.append(f"no {MANIFEST} yet")
        else:
            view.manifest = json.loads(data)
    except (OSError, ValueError) as exc:
        view.problems.append(f"{MANIFEST}: {exc}")
    try:
        view.rows = read_stats_rows(store)
    except Exception as exc:          # a torn or foreign file: show the rest of the run
        view.problems.append(f"{STATS_FILE}/: {exc}")
    return view


def version_token(run_dir: str | Path) -> str:
    """Changes whenever manifest.json is rewritten or a stats file is added (a rename into the
    folder changes its mtime); for live reloads of a local run directory."""
    parts = []
    for rel in (MANIFEST, STATS_FILE):
        try:
            st = (Path(run_dir) / rel).stat()
            parts.append(f"{st.st_mtime_ns}-{st.st_size}")
        except OSError:
            parts.append("-")
    return ":".join(parts)
