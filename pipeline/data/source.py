"""Open `data.path` (a Parquet file, a directory of them, or a glob) lazily.

Only metadata is read here: the file list, each file's row count and the schema. A row's
position in the dataset is its index in the concatenation of the files in sorted order, so it
is stable from run to run and across resumes.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.dataset as ds

from pipeline.config import UserError

_GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Source:
    files: tuple[str, ...]       # absolute paths, sorted
    file_rows: tuple[int, ...]   # rows per file, from Parquet metadata
    schema: pa.Schema            # unified schema of the dataset

    @property
    def total_rows(self) -> int:
        return sum(self.file_rows)

    def dataset(self) -> ds.Dataset:
        return ds.dataset(list(self.files), format="parquet")


def list_files(path: str) -> list[str]:
    """Sorted Parquet files named by `path`; UserError when there are none."""
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
    files = list_files(path)
    dataset = ds.dataset(files, format="parquet")
    rows = tuple(fragment.metadata.num_rows for fragment in dataset.get_fragments())
    return Source(files=tuple(files), file_rows=rows, schema=dataset.schema)
