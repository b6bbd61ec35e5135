"""`model.path` on a cluster: a path every node sees, or a URI each node fetches once.

- A local path (or `file://`): every node loads the checkpoint from that path itself, so it
  must exist on every node (a shared mount such as NFS or a PVC, or the same copy baked into
  each node's image).
- `s3://`, `gs://`, ... (anything pyarrow's filesystems open): each node downloads the
  checkpoint once into a local cache, `$SPECBATCH_CACHE/models/<hash of the URI>` (default
  `~/.cache/specbatch/models/...`). A file lock makes the actors of one node share one
  download; the copy is made under a temporary name and renamed when complete, so a crash
  mid-download is never mistaken for a checkpoint.

When a node cannot see the checkpoint the actor fails with `ModelNotVisible`, whose message
names the node and the path.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

import pyarrow.fs as pafs

from pipeline.config import UserError
from pipeline.data.storage import is_file, is_remote, is_uri, locate

CONFIG = "config.json"


class ModelNotVisible(UserError):
    """A node cannot read model.path."""


def cache_root() -> Path:
    base = os.environ.get("SPECBATCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specbatch")
    return Path(base) / "models"


def cache_dir_for(uri: str, root: Path | None = None) -> Path:
    """The local folder a URI's checkpoint is fetched into: 'NAME-HASH' (the same on every node)."""
    name = uri.split("?")[0].rstrip("/").rsplit("/", 1)[-1] or "model"
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    return (root or cache_root()) / f"{name}-{digest}"


def fetch_model(uri: str, root: Path | None = None) -> str:
    """Download the checkpoint at `uri` once per node; returns the local folder."""
    target = cache_dir_for(uri, root)
    if (target / CONFIG).is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # other actors on this node wait here
        if (target / CONFIG).is_file():
            return str(target)
        fs, src = locate(uri)
        if not is_file(fs, f"{src.rstrip('/')}/{CONFIG}"):
            raise FileNotFoundError(f"{uri} has no {CONFIG}")
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        pafs.copy_files(src, str(tmp), source_filesystem=fs,
                        destination_filesystem=pafs.LocalFileSystem())
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    return str(target)


def local_model_path(path: str, root: Path | None = None) -> str:
    """A local folder holding the checkpoint: fetched for a remote URI, checked otherwise."""
    if is_remote(path):
        return fetch_model(path, root)
    local = locate(path)[1] if is_uri(path) else path
    if not Path(local).exists():
        raise FileNotFoundError(f"{local} does not exist")
    if not (Path(local) / CONFIG).is_file():
        raise FileNotFoundError(f"{local} has no {CONFIG}")
    return local


def model_on_node(path: str, node: str, root: Path | None = None) -> str:
    """local_model_path, with an error that names the node and the path."""
    try:
        return local_model_path(path, root)
    except (OSError, ValueError) as exc:   # pyarrow's errors are OSError / ArrowInvalid
        raise ModelNotVisible(
            f"node {node} cannot see model.path {path!r}: {exc}. Every node loads the "
            "checkpoint itself: use a path every node mounts (or the same copy on each node), "
            "or a URI such as s3://bucket/model that each node downloads once "
            "(see infra/README.md)") from None
