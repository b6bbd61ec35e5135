"""Open `data.path` (a Parquet file, a directory of them, or a glob; a local path or a URI such
as s3://bucket/prefix/*.parquet) lazily.

Only metadata is read here: the file list, each file's row count and the schema. A row's
position in the dataset is its index in the concatenation of the files in sorted order, so it
is stable from run to run and across resumes.
"""
from __future__ import annotations

import fnmatch
import glob
import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.config import UserError
from pipeline.data.storage import file_uri, is_remote, is_uri, locate

_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Source:
    files: tuple[str, ...]       # absolute paths or URIs, sorted
    file_rows: tuple[int, ...]   # rows per file, from Parquet metadata
    schema: pa.Schema            # unified schema of the dataset

    @property
    def total_rows(self) -> int:
        return sum(self.file_rows)

    def dataset(self) -> ds.Dataset:
        return _dataset(list(self.files))


def _dataset(files: list[str]) -> ds.Dataset:
    if files and is_remote(files[0]):
        fs = locate(files[0])[0]
        return ds.dataset([locate(f)[1] for f in files], filesystem=fs, format="parquet")
    return ds.dataset(files, format="parquet")


def _hidden(rel: str) -> bool:
    return any(part.startswith((".", "_")) for part in rel.split("/"))


def list_remote(uri: str) -> list[str]:
    """Parquet files named by a remote URI (file, folder or glob), as URIs."""
    fs, root = pafs.FileSystem.from_uri(uri)
    if any(c in root for c in _GLOB_CHARS):
        prefix = root[:min(root.find(c) for c in _GLOB_CHARS if c in root)].rsplit("/", 1)[0]
        infos = fs.get_file_info(pafs.FileSelector(prefix, recursive=True, allow_not_found=True))
        paths = [i.path for i in infos if i.type == pafs.FileType.File and fnmatch.fnmatch(i.path, root)]
    elif fs.get_file_info(root).type == pafs.FileType.File:
        paths = [root]
    else:
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        paths = [i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet")
                 and not _hidden(i.path[len(root):].lstrip("/"))]
    return [file_uri(uri, p) for p in paths]


def list_files(path: str) -> list[str]:
    """Sorted Parquet files named by `path`; UserError when there are none."""
    if is_remote(path):
        files = list_remote(path)
        if not files:
            raise UserError(f"data.path {path!r} names no Parquet files (or does not exist)")
        return sorted(files)
    if is_uri(path):                      # file://
        path = locate(path)[1]
    if any(c in path for c in _GLOB_CHARS):
        files = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f)]
    elif os.path.isdir(path):
        # pyarrow's discovery skips hidden and '_'-prefixed files (temp, _SUCCESS, ...)
        files = [f for f in ds.dataset(path, format="parquet").files if f.endswith(".parquet")]
    elif os.path.isfile(path):
        files = [path]
    else:
        raise UserError(f"data.path {path!r} does not exist")
    if not files:
        raise UserError(f"data.path {path!r} names no Parquet files")
    return sorted(os.path.abspath(f) for f in files)


def open_source(path: str) -> Source:
    """The dataset's files, row counts and schema (footers only). A file that is missing,
    unreadable or not Parquet is a UserError naming it."""
    try:
        files = list_files(path)
    except _READ_ERRORS as exc:
        raise UserError(f"data.path {path!r} cannot be read: {exc}") from None
    try:
        dataset = _dataset(files)
        rows = tuple(fragment.metadata.num_rows for fragment in dataset.get_fragments())
    except _READ_ERRORS as exc:
        raise UserError(f"data.path {path!r}: {_unreadable(files, exc)}") from None
    return Source(files=tuple(files), file_rows=rows, schema=dataset.schema)


def _unreadable(files: list[str], exc: Exception) -> str:
    """Which file could not be opened (footers are read one by one: this is the error path)."""
    for f in files:
        try:
            fs, where = locate(f)
            pq.ParquetFile(where, filesystem=fs).metadata
        except _READ_ERRORS as file_exc:
            return f"{f} is not a readable Parquet file: {file_exc}"
    return f"cannot be read: {exc}"


_READ_ERRORS = (OSError, ValueError, pa.ArrowException)   # ArrowInvalid is a ValueError
