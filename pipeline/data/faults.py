"""Fault injection for tests: stop an atomic write half-way, so a test can kill a run inside it.

With SPECBATCH_FAULT_STALL_WRITE=GLOB in the environment (inherited by Ray's workers), an
atomic table write whose final file name matches GLOB (e.g. `part-00004.parquet`) writes
half of the file's bytes to its temporary name, flushes them, and then waits for ever: the
test sees the partial temporary file and kills the run there. Unset, nothing changes.
"""
from __future__ import annotations

import fnmatch
import os
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

STALL_WRITE = "SPECBATCH_FAULT_STALL_WRITE"


def stalls(path: str) -> bool:
    pattern = os.environ.get(STALL_WRITE)
    return bool(pattern) and fnmatch.fnmatch(path.rpartition("/")[2], pattern)


def stall_half_way(fs: pafs.FileSystem, tmp: str, table: pa.Table) -> None:
    """Write the first half of `table`'s Parquet bytes to `tmp`, flush, and never return."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    data = sink.getvalue().to_pybytes()
    with fs.open_output_stream(tmp) as out:
        out.write(data[:len(data) // 2])
        out.flush()
        while True:
            time.sleep(3600)
