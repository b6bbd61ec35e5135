"""The demo's three tasks: one prompt format each, built from a FunctionRecord.

    summarize: the function's source without its docstring -> first line of its docstring
    complete:  the start of a function (header, docstring, first body lines) -> the rest
    json:      the function's signature -> {"name", "parameters", "defaults"} as JSON

`TEMPLATES[task].format(text=...)` is the prompt; the model's answer follows it directly and ends
with the tokenizer's eos token. The dataset's `text` column holds what `{text}` reads.
"""
from __future__ import annotations

import ast
import json

from pipeline.demo.extract import FunctionRecord

TASKS = ("summarize", "complete", "json")
TEMPLATES = {
    "summarize": "Summarize:\n{text}\nSummary:",
    "complete": "{text}",
    "json": "Signature:\n{text}\nJSON:",
}
MAX_COMPLETE_LINES = 12      # reference length cap for `complete`


def signature_json(header: str) -> str | None:
    """The JSON answer for a function header, e.g.

    >>> signature_json("def f(a, b=1, *args, c=None, **kw):")
    '{"name": "f", "parameters": ["a", "b", "*args", "c", "**kw"], "defaults": {"b": "1", "c": "None"}}'
    """
    try:
        tree = ast.parse(header.strip() + "\n    pass")
    except SyntaxError:
        return None
    fn = tree.body[0]
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    a = fn.args
    positional = a.posonlyargs + a.args
    names = [p.arg for p in positional]
    defaults = dict(zip(names[len(names) - len(a.defaults):],
                        (ast.unparse(d) for d in a.defaults)))
    if a.vararg:
        names.append("*" + a.vararg.arg)
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        names.append(p.arg)
        if d is not None:
            defaults[p.arg] = ast.unparse(d)
    if a.kwarg:
        names.append("**" + a.kwarg.arg)
    return json.dumps({"name": fn.name, "parameters": names, "defaults": defaults})


def complete_split(rec: FunctionRecord) -> tuple[str, str] | None:
    """Split a function into (start, rest): the start keeps the header, docstring and about a
    third of the body; the rest (at most MAX_COMPLETE_LINES lines) begins with a newline."""
    lines = rec.source.splitlines()
    body = len(lines) - rec.body_start
    if body < 3:
        return None
    cut = rec.body_start + max(1, body // 3)
    start = "\n".join(lines[:cut])
    rest = "\n" + "\n".join(lines[cut: cut + MAX_COMPLETE_LINES])
    return start, rest


def task_pairs(rec: FunctionRecord) -> list[tuple[str, str, str]]:
    """(task, text, reference) for every task this function supports."""
    out = []
    if rec.summary:
        out.append(("summarize", rec.code, " " + rec.summary))
    split = complete_split(rec)
    if split is not None:
        out.append(("complete", split[0], split[1]))
    sig = signature_json(rec.header)
    if sig is not None:
        out.append(("json", rec.header, " " + sig))
    return out


def prompt_for(task: str, text: str) -> str:
    return TEMPLATES[task].format(text=text)


def training_texts(rec: FunctionRecord) -> list[tuple[str, str, str]]:
    """(kind, prompt, answer) triples for LM training from one training-split function. The raw
    source (kind "raw", prompt "") teaches code and doubles as the `complete` task."""
    out = [("raw", "", rec.source)]
    for task, text, ref in task_pairs(rec):
        if task != "complete":
            out.append((task, prompt_for(task, text), ref))
    return out
