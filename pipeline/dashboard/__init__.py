"""The stats dashboard: `python -m pipeline.dashboard RUN_DIR` writes RUN_DIR/report.html.

`write_report(run_dir)` is what every run calls at the end; `--serve` (serve.py) serves the
report live on 127.0.0.1 while a run is in progress.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.dashboard.load import RunView, load_run

REPORT = "report.html"


def render_report(run_dir, poll_url: str | None = None, poll_ms: int = 3000) -> str:
    """The page as a string; with poll_url it reloads itself when that URL's text changes."""
    from pipeline.dashboard.page import render

    return render(load_run(run_dir), poll_url=poll_url, poll_ms=poll_ms)


def write_report(run_dir: str | Path) -> Path | str:
    """Write RUN_DIR/report.html atomically (a reader never sees half a page); RUN_DIR may be
    a local path or a URI, as output.dir may."""
    from pipeline.data.storage import open_store, write_bytes_atomic

    store = open_store(run_dir)
    path = store.path(REPORT)
    write_bytes_atomic(store.fs, path, render_report(store).encode())
    return store.show(path)


__all__ = ["REPORT", "RunView", "load_run", "render_report", "write_report"]
