"""Where a run directory lives: a local path or a URI that pyarrow's filesystems understand.

`output.dir` may be `runs/x`, `/abs/x`, `file:///abs/x`, `s3://bucket/prefix` or
`gs://bucket/prefix` (query parameters such as `?endpoint_override=host:port&scheme=http`
configure the S3 client; credentials come from the environment, as the AWS/GCS SDKs read
them, e.g. AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL). A `Store` is that directory opened once:
a pyarrow filesystem and the directory's path on it.

Atomic writes: a file is written under a hidden temporary name next to its final name, then
moved. On a local disk the move is a rename, so a reader sees the old file or the new one,
never part of one. On S3 (and GCS) a move is a server-side copy and a delete: the final key is
created only by that copy, which completes in one request, so a part file appears only when it
is complete, because it was first written in full under the temporary key.
"""
from __future__ import annotations

import fnmatch
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.data.faults import stall_half_way, stalls

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
TEMP_GLOB = ".*.tmp-*"


def is_uri(path: str | Path) -> bool:
    """True for 's3://...', 'gs://...', 'file://...'; False for plain paths."""
    return isinstance(path, str) and bool(_URI.match(path))


def is_remote(path: str | Path) -> bool:
    """A URI whose filesystem is not this machine's disk (file:// is local)."""
    return is_uri(path) and not str(path).startswith("file://")


@dataclass(frozen=True)
class Store:
    fs: pafs.FileSystem
    root: str          # the directory's path on fs: absolute locally, 'bucket/prefix' on S3
    uri: str           # as given (messages; actors re-open the store from it)

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, pafs.LocalFileSystem)

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def show(self, path: str) -> Path | str:
        """A path as callers get it back: a Path locally, the filesystem path otherwise."""
        return Path(path) if self.is_local else path


Where = Union[str, Path, Store]


def open_store(where: Where) -> Store:
    """The directory `where` (a path, a URI, or an open Store) on its filesystem."""
    if isinstance(where, Store):
        return where
    if is_uri(where):
        fs, root = pafs.FileSystem.from_uri(str(where))
        return Store(fs, root.rstrip("/") or root, str(where))
    return Store(pafs.LocalFileSystem(), os.path.abspath(str(where)), str(where))


def locate(path: str | Path, fs: pafs.FileSystem | None = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path on it) of one file: `fs` given, a URI, or a local path."""
    if fs is not None:
        return fs, str(path)
    if is_uri(path):
        return pafs.FileSystem.from_uri(str(path))
    return pafs.LocalFileSystem(), os.path.abspath(str(path))


def file_uri(base_uri: str, path: str) -> str:
    """The URI of `path` on the filesystem of `base_uri`, keeping its query (S3 options):
    ('s3://b/data?scheme=http', 'b/data/x.parquet') -> 's3://b/data/x.parquet?scheme=http'."""
    scheme = base_uri.split("://", 1)[0]
    query = base_uri.partition("?")[2]
    return f"{scheme}://{path}" + (f"?{query}" if query else "")


def open_parquet(path: str) -> pq.ParquetFile:
    """A Parquet file by local path or URI."""
    fs, where = locate(path)
    return pq.ParquetFile(where, filesystem=fs)


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if "/" in path else ""


def _ensure_parent(fs: pafs.FileSystem, path: str) -> None:
    if isinstance(fs, pafs.LocalFileSystem):   # object stores have no directories to make
        fs.create_dir(_parent(path), recursive=True)


def temp_name(path: str) -> str:
    """'.../outputs/part-00001.parquet' -> '.../outputs/.part-00001.parquet.tmp-PID-RANDOM'
    (unique across processes and nodes, hidden from Parquet dataset discovery)."""
    parent, _, name = path.rpartition("/")
    return f"{parent}/.{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def publish(fs: pafs.FileSystem, tmp: str, path: str) -> None:
    """Move a completely written temporary file to its final name (see the module doc)."""
    try:
        fs.move(tmp, path)
    except NotImplementedError:        # a filesystem without moves: copy, then delete
        fs.copy_file(tmp, path)
        fs.delete_file(tmp)


def write_bytes_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    _ensure_parent(fs, path)
    tmp = temp_name(path)
    with fs.open_output_stream(tmp) as out:
        out.write(data)
    publish(fs, tmp, path)


def write_table_atomic(fs: pafs.FileSystem, path: str, table: pa.Table) -> None:
    _ensure_parent(fs, path)
    tmp = temp_name(path)
    if stalls(path):                   # fault injection for tests (faults.py); off unless set
        stall_half_way(fs, tmp, table)
    pq.write_table(table, tmp, filesystem=fs)
    publish(fs, tmp, path)


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes | None:
    """The file's bytes, or None when it does not exist."""
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        return f.read()


def is_file(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type == pafs.FileType.File


def list_names(fs: pafs.FileSystem, folder: str) -> list[str]:
    """Base names of the files directly in `folder` ([] when it does not exist)."""
    infos = fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
    return sorted(i.base_name for i in infos if i.type == pafs.FileType.File)


def delete_files(fs: pafs.FileSystem, paths) -> int:
    """Delete those of `paths` that are files; returns how many were."""
    removed = 0
    for path in paths:
        if is_file(fs, path):
            fs.delete_file(path)
            removed += 1
    return removed


def remove_temp(fs: pafs.FileSystem, folder: str) -> int:
    """Delete leftovers of interrupted atomic writes in `folder`; returns how many."""
    return delete_files(fs, [f"{folder}/{name}" for name in list_names(fs, folder)
                             if fnmatch.fnmatch(name, TEMP_GLOB)])


def hydra_dir(output_dir: str) -> str:
    """A local directory for Hydra's own files: output.dir itself when it is local, else a
    folder under runs/_hydra named after the URI (Hydra writes only to local disk)."""
    if not is_uri(output_dir):
        return output_dir
    if output_dir.startswith("file://"):
        return pafs.FileSystem.from_uri(output_dir)[1]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", output_dir.split("?")[0]).strip("_")
    return os.path.join("runs", "_hydra", name)
