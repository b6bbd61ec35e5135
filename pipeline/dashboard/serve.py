"""`--serve`: the report live on 127.0.0.1, plus the run directory's own files, nothing else.

GET / (or /report.html) renders the report from what stats/ and manifest.json hold now (cached
until either changes); /_version is a token that changes when they do, which the page polls to
reload itself while the run is in progress. Any other path is a file inside the run directory:
paths that resolve outside it (.., absolute, symlinks out) are refused with 404.
"""
from __future__ import annotations

import mimetypes
import sys
import threading
from functools import partial
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from pipeline.dashboard import render_report
from pipeline.dashboard.load import version_token

VERSION_PATH = "/_version"


def resolve_inside(root: Path, url_path: str) -> Path | None:
    """The file `url_path` names inside `root`, or None when it is not a file there."""
    rel = unquote(urlsplit(url_path).path).lstrip("/")
    if "\x00" in rel:
        return None
    root = root.resolve()
    target = (root / rel).resolve()
    if not target.is_relative_to(root) or not target.is_file():
        return None
    return target


class ReportCache:
    """The rendered page for the run directory's current version token."""

    def __init__(self, run_dir: Path, poll_ms: int):
        self.run_dir, self.poll_ms = run_dir, poll_ms
        self.lock = threading.Lock()
        self.token: str | None = None
        self.page = b""

    def get(self) -> bytes:
        with self.lock:
            token = version_token(self.run_dir)
            if token != self.token:
                self.page = render_report(self.run_dir, poll_url=VERSION_PATH, poll_ms=self.poll_ms).encode()
                self.token = token
            return self.page


class Handler(BaseHTTPRequestHandler):
    def __init__(self, *args, cache: ReportCache, **kwargs):
        self.cache = cache
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = urlsplit(self.path).path
        if path in ("/", "/report.html"):
            self._send(self.cache.get(), "text/html; charset=utf-8")
        elif path == VERSION_PATH:
            self._send(version_token(self.cache.run_dir).encode(), "text/plain")
        else:
            target = resolve_inside(self.cache.run_dir, self.path)
            if target is None:
                self.send_error(HTTPStatus.NOT_FOUND, "not a file of this run directory")
                return
            kind = mimetypes.guess_type(target.name)[0] or "application/octet-stream"
            self._send(target.read_bytes(), kind)

    def _send(self, body: bytes, kind: str) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
        pass


def make_server(run_dir: str | Path, port: int = 0, poll_s: float = 3.0) -> ThreadingHTTPServer:
    """A server bound to 127.0.0.1:port (0: a free port; see .server_address)."""
    cache = ReportCache(Path(run_dir), int(poll_s * 1000))
    server = ThreadingHTTPServer(("127.0.0.1", port), partial(Handler, cache=cache))
    server.daemon_threads = True
    return server


def serve_forever(run_dir: str | Path, port: int = 8600, poll_s: float = 3.0) -> None:
    server = make_server(run_dir, port, poll_s)
    host, bound = server.server_address[:2]
    print(f"serving {run_dir} on http://{host}:{bound}/ (Ctrl-C to stop)", file=sys.stderr)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
