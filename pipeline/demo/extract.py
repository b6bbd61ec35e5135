"""Extract documented functions from the Python standard library's source.

Every Python installation carries its standard library as source; the demo model is trained on it
and evaluated on functions held out of training. A function is held out by a stable hash of its
code (without docstring), so duplicated functions land on the same side of the split.
"""
from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"}
MAX_CODE_CHARS = 1400        # code without docstring, i.e. the summarize prompt body
MAX_SOURCE_CHARS = 1800      # whole function source, i.e. raw LM text and the complete task
MIN_SUMMARY_CHARS = 12
MAX_SUMMARY_CHARS = 160


@dataclass(frozen=True)
class FunctionRecord:
    module: str          # dotted module name, e.g. "json.decoder"
    qualname: str        # e.g. "JSONDecoder.decode"
    source: str          # dedented function source starting at `def`, docstring included
    code: str            # the same source with the docstring lines removed
    header: str          # the signature lines, `def ...:` up to the first body statement
    summary: str         # first line of the docstring; "" when it has none usable
    body_start: int      # index (in source lines) of the first line after the docstring
    heldout: bool        # True: never used for training


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def iter_stdlib_files(root: Path) -> Iterator[Path]:
    """Yield the standard library's .py files in a stable (sorted) order, tests excluded."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath) / name


def heldout_bucket(code: str) -> int:
    """Stable 0..99 bucket of a function's code; buckets < heldout_percent are held out."""
    return int(hashlib.sha1(code.encode("utf-8")).hexdigest()[:8], 16) % 100


def _iter_functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _iter_functions(node, prefix + node.name + ".<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from _iter_functions(node, prefix + node.name + ".")


def _dedent(lines: list[str], col: int) -> list[str]:
    """Remove exactly `col` leading spaces where present (multi-line strings may have fewer)."""
    pad = " " * col
    return [ln[col:] if ln.startswith(pad) else ln.lstrip(" ") if not ln.strip() else ln
            for ln in lines]


def function_record(module: str, qualname: str, node: ast.AST, lines: list[str],
                    heldout_percent: int) -> FunctionRecord | None:
    """Build a record for one function, or None when it does not fit the demo's tasks."""
    doc = ast.get_docstring(node, clean=True)
    first, last = node.lineno - 1, node.end_lineno            # source lines [first, last)
    body0 = node.body[0].lineno - 1                           # first body statement's line
    if body0 <= first:
        return None                                           # one-line function
    d0 = d1 = body0                                           # docstring lines [d0, d1)
    summary = ""
    if doc:
        if len(node.body) < 2 or node.body[1].lineno - 1 < node.body[0].end_lineno:
            return None                                       # nothing but a docstring
        d1 = node.body[0].end_lineno
        summary = doc.strip().splitlines()[0].strip()
        if not MIN_SUMMARY_CHARS <= len(summary) <= MAX_SUMMARY_CHARS:
            summary = ""
    src = _dedent(lines[first:last], node.col_offset)
    if any("\t" in ln[: len(ln) - len(ln.lstrip())] for ln in src):
        return None                                           # tab-indented: skip
    code_lines = src[: d0 - first] + src[d1 - first:]
    source, code = "\n".join(src).rstrip(), "\n".join(code_lines).rstrip()
    if len(source) > MAX_SOURCE_CHARS or len(code) > MAX_CODE_CHARS:
        return None
    header = "\n".join(src[: d0 - first]).rstrip()
    return FunctionRecord(module=module, qualname=qualname, source=source, code=code,
                          header=header, summary=summary, body_start=d1 - first,
                          heldout=heldout_bucket(code) < heldout_percent)


def extract_functions(root: Path | None = None, heldout_percent: int = 15) -> list[FunctionRecord]:
    """All usable functions of the standard library, deduplicated by code."""
    root = root or stdlib_root()
    seen: set[str] = set()
    records: list[FunctionRecord] = []
    for path in iter_stdlib_files(root):
        rel = path.relative_to(root).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = text.splitlines()
        for qualname, node in _iter_functions(tree):
            rec = function_record(module, qualname, node, lines, heldout_percent)
            if rec is not None and rec.code not in seen:
                seen.add(rec.code)
                records.append(rec)
    return records


def pydoc_topics() -> list[str]:
    """The documentation topics every installation ships (`pydoc_data.topics`), sorted."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [topics[k] for k in sorted(topics)]
