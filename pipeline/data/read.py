"""Read one shard's rows: only the row groups overlapping its range, only the needed columns."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.config import UserError
from pipeline.data.plan import Shard
from pipeline.data.storage import open_parquet

POSITION = "__position__"   # the row's position in the dataset, added to every shard table


def read_range(files: tuple[str, ...], file_rows: tuple[int, ...], start: int, stop: int,
               columns: list[str]) -> pa.Table:
    """Rows [start, stop) of the files' concatenation, with a POSITION column."""
    pieces = []
    file_start = 0
    for path, n in zip(files, file_rows):
        file_stop = file_start + n
        if file_stop > start and file_start < stop:
            pieces.append(_read_file_range(path, start - file_start, stop - file_start,
                                           columns, file_start))
        file_start = file_stop
        if file_start >= stop:
            break
    if not pieces:
        raise ValueError(f"rows [{start}, {stop}) are outside the dataset ({file_start} rows)")
    return pa.concat_tables(pieces, promote_options="default")


def _read_file_range(path: str, lo: int, hi: int, columns: list[str], base: int) -> pa.Table:
    """Rows [lo, hi) of one file (clipped to it), reading only overlapping row groups."""
    pf = open_parquet(path)
    lo, hi = max(lo, 0), min(hi, pf.metadata.num_rows)
    groups, group_start, first_start = [], 0, None
    for g in range(pf.metadata.num_row_groups):
        group_stop = group_start + pf.metadata.row_group(g).num_rows
        if group_stop > lo and group_start < hi:
            groups.append(g)
            first_start = group_start if first_start is None else first_start
        group_start = group_stop
    table = pf.read_row_groups(groups, columns=columns).slice(lo - first_start, hi - lo)
    positions = pa.array(range(base + lo, base + hi), type=pa.int64())
    return table.append_column(POSITION, positions)


def read_shard(files: tuple[str, ...], file_rows: tuple[int, ...], shard: Shard,
               columns: list[str], task_column: str | None = None,
               tasks: tuple[str, ...] | None = None) -> pa.Table:
    """The shard's kept rows (those of `tasks` when given) with the needed columns."""
    wanted = list(dict.fromkeys(columns + ([task_column] if tasks else [])))
    table = read_range(files, file_rows, shard.start, shard.stop, wanted)
    if tasks:
        values = pa.array(list(tasks), type=pa.string())
        mask = pc.fill_null(pc.is_in(table[task_column].cast(pa.string()), value_set=values), False)
        table = table.filter(mask)
    if table.num_rows != shard.num_rows:
        raise UserError(f"shard {shard.shard_id}: read {table.num_rows} rows, planned "
                           f"{shard.num_rows}; did the dataset change since the plan?")
    return table.select(list(dict.fromkeys(columns)) + [POSITION])
