"""Fingerprints of a run's inputs, so a resume can tell that the checkpoint or dataset changed.

A run records them in its manifest (`inputs`); `resume=true` compares them with what is there
now and refuses a changed input, naming what changed (record.py). Reading whole checkpoints
would take minutes, so a file is identified by what is cheap to read and changes when it does:
- checkpoint (`model.path`): config.json's hash, and per weight file its size, the hash of
  its safetensors header (names, dtypes, shapes, offsets) and a hash of 16 evenly spaced
  64 KiB samples of its bytes (new weights of the same shapes change those);
- dataset (`data.path`): per Parquet file its size, row count and a hash of its footer
  (schema, row groups and their column statistics).
Only local checkpoints are fingerprinted; a URI (fetched by each node) records None.
"""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

from pipeline.data.source import Source
from pipeline.data.storage import is_uri, locate

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAMPLES, SAMPLE_BYTES = 16, 64 * 1024


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def sampled_hash(f, size: int) -> str:
    """Hash of SAMPLES evenly spaced SAMPLE_BYTES-long pieces of an open binary file."""
    h = hashlib.sha256()
    step = max(0, size - SAMPLE_BYTES) / max(1, SAMPLES - 1)
    for i in range(SAMPLES):
        f.seek(int(i * step))
        h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:16]


def safetensors_header_hash(f) -> str | None:
    """Hash of a safetensors file's JSON header (8-byte little-endian length, then the JSON)."""
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    if n > 100 * 2**20:
        return None
    return _sha(f.read(n))


def checkpoint_fingerprint(path: str) -> dict[str, Any] | None:
    """{file name: {size, header, sample}} for config.json and the weight files; None for a
    URI or a directory the driver cannot see (a cluster whose nodes hold the model)."""
    if is_uri(path):
        return None
    root = Path(path)
    if not (root / "config.json").is_file():
        return None
    files: dict[str, Any] = {"config.json": {"sha": _sha((root / "config.json").read_bytes())}}
    for p in sorted(root.rglob("*")):
        if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name.endswith(".index.json")):
            size = p.stat().st_size
            with open(p, "rb") as f:
                entry = {"size": size, "sample": sampled_hash(f, size)}
                if p.suffix == ".safetensors":
                    entry["header"] = safetensors_header_hash(f)
            files[p.relative_to(root).as_posix()] = entry
    return files


def parquet_footer_hash(fs, where: str, size: int) -> str | None:
    """Hash of a Parquet file's footer (its last 8 bytes give the footer's length)."""
    if size < 12:
        return None
    with fs.open_input_file(where) as f:
        f.seek(size - 8)
        tail = f.read(8)
        (n,) = struct.unpack("<I", tail[:4])
        if tail[4:] != b"PAR1" or n + 8 > size:
            return None
        f.seek(size - 8 - n)
        return _sha(f.read(n))


def dataset_fingerprint(source: Source) -> dict[str, Any]:
    """{file: {size, rows, footer}} for every file of the dataset, in order."""
    files: dict[str, Any] = {}
    for path, rows in zip(source.files, source.file_rows):
        fs, where = locate(path)
        size = fs.get_file_info(where).size
        files[path] = {"size": size, "rows": rows, "footer": parquet_footer_hash(fs, where, size)}
    return files


def describe_changes(kind: str, before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints, e.g. ["model.safetensors: size 10 -> 12"]."""
    changes = [f"{kind} file removed: {name}" for name in before if name not in now]
    changes += [f"{kind} file added: {name}" for name in now if name not in before]
    for name in before:
        if name in now and before[name] != now[name]:
            what = [f"{k} {before[name].get(k)} -> {now[name].get(k)}"
                    for k in sorted(set(before[name]) | set(now[name]))
                    if before[name].get(k) != now[name].get(k)]
            changes.append(f"{name}: " + ", ".join(what))
    return changes
