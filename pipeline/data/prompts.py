"""Turn a shard's rows into prompts and ids (`data.prompt_column` / `data.template`)."""
from __future__ import annotations

import string

import pyarrow as pa

from pipeline.config import DataConfig, UserError
from pipeline.data.read import POSITION


def template_fields(template: str) -> list[str]:
    """Column names a format string reads: 'Q: {question}\\nA: {a.b}' -> ['question', 'a']."""
    fields = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is None:
            continue
        base = name.split(".")[0].split("[")[0]
        if base == "" or base.isdigit():
            raise UserError(f"data.template {template!r}: fields must name columns, e.g. {{text}}")
        fields.append(base)
    return list(dict.fromkeys(fields))


def prompt_columns(data: DataConfig) -> list[str]:
    return template_fields(data.template) if data.template is not None else [data.prompt_column]


def needed_columns(data: DataConfig, keep_columns: tuple[str, ...]) -> list[str]:
    """Every input column a shard reads (prompt sources, id, task, keep_columns)."""
    cols = prompt_columns(data) + [c for c in (data.id_column, data.task_column) if c]
    return list(dict.fromkeys(cols + list(keep_columns)))


def check_columns(schema: pa.Schema, data: DataConfig, keep_columns: tuple[str, ...]) -> None:
    """UserError naming every configured column the dataset lacks."""
    missing = [c for c in needed_columns(data, keep_columns) if c not in schema.names]
    if missing:
        named = [c for c in missing if data.template is not None and c in template_fields(data.template)]
        why = f" (data.template {data.template!r} names {named})" if named else ""
        raise UserError(f"data.path has no column(s) {missing}{why}; its columns are {schema.names}")
    if data.template is None:
        kind = schema.field(data.prompt_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)
                or str(kind) == "string_view"):
            raise UserError(f"data.prompt_column {data.prompt_column!r} holds {kind}, not strings; "
                            f"name a text column, or format this one with "
                            f"data.template='{{{data.prompt_column}}}'")


def build_prompts(table: pa.Table, data: DataConfig) -> tuple[list[str | None], list[str | None]]:
    """(prompt, error) per row: a row whose prompt cannot be built gets an error, not a crash."""
    prompts: list[str | None] = []
    errors: list[str | None] = []
    if data.template is None:
        for value in table[data.prompt_column].to_pylist():
            ok = isinstance(value, str)
            prompts.append(value if ok else None)
            errors.append(None if ok else f"prompt column {data.prompt_column!r} is {value!r}")
        return prompts, errors
    fields = template_fields(data.template)
    for row in table.select(fields).to_pylist():
        nulls = [k for k, v in row.items() if v is None]
        if nulls:
            prompts.append(None)
            errors.append(f"template column(s) {nulls} are null")
            continue
        try:
            prompts.append(data.template.format(**row))
            errors.append(None)
        except (KeyError, IndexError, ValueError, AttributeError, TypeError) as exc:
            prompts.append(None)
            errors.append(f"template failed: {exc!r}")
    return prompts, errors


def row_ids(table: pa.Table, data: DataConfig) -> pa.Array:
    """The id column, or the row's position in the dataset."""
    column = table[data.id_column] if data.id_column else table[POSITION]
    return column.combine_chunks()


def row_tasks(table: pa.Table, data: DataConfig) -> list[str]:
    """Each row's task name ('default' without a task column; null -> 'default')."""
    if not data.task_column:
        return ["default"] * table.num_rows
    return ["default" if v is None else str(v) for v in table[data.task_column].to_pylist()]
