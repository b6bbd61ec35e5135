"""Plan shards as row ranges of the dataset, without holding the dataset.

Without a task filter the plan comes from metadata alone. With `data.tasks` only the task
column is streamed, one record batch at a time, to place shard boundaries so that each shard
holds `rows_per_shard` kept rows; memory stays O(number of shards).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline.data.source import Source
from pipeline.data.storage import open_parquet


@dataclass(frozen=True)
class Shard:
    shard_id: int
    start: int      # first dataset row position in the shard (inclusive)
    stop: int       # end of the range (exclusive)
    num_rows: int   # rows of [start, stop) the shard keeps (all, or those of the listed tasks)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_ranges(total_rows: int, rows_per_shard: int, limit: int | None = None) -> list[Shard]:
    """Contiguous shards over the first min(total_rows, limit) rows."""
    n = total_rows if limit is None else min(total_rows, limit)
    return [Shard(i, start, min(start + rows_per_shard, n), min(start + rows_per_shard, n) - start)
            for i, start in enumerate(range(0, n, rows_per_shard))]


def plan_filtered(kept_positions: Iterable[np.ndarray], rows_per_shard: int,
                  limit: int | None = None) -> list[Shard]:
    """Shards holding `rows_per_shard` kept rows each, from chunks of kept row positions.

    kept_positions yields increasing int arrays of dataset positions whose row is kept,
    e.g. [3, 4, 9], [12, 15]; with rows_per_shard=2 the shards are [0, 5) (rows 3, 4),
    [5, 13) (9, 12) and [13, 16) (15).
    """
    shards: list[Shard] = []
    start, in_shard, total = 0, 0, 0
    for positions in kept_positions:
        for pos in positions.tolist():
            if limit is not None and total >= limit:
                break
            in_shard += 1
            total += 1
            if in_shard == rows_per_shard:
                shards.append(Shard(len(shards), start, pos + 1, in_shard))
                start, in_shard = pos + 1, 0
            last = pos
        if limit is not None and total >= limit:
            break
    if in_shard:
        shards.append(Shard(len(shards), start, last + 1, in_shard))
    return shards


def iter_kept_positions(source: Source, task_column: str, tasks: tuple[str, ...],
                        batch_size: int = 65536) -> Iterable[np.ndarray]:
    """Positions of rows whose task is in `tasks`, streamed from the task column only."""
    offset = 0
    value_set = pa.array(list(tasks), type=pa.string())
    for path in source.files:  # file by file, in order: positions stay exact
        for batch in open_parquet(path).iter_batches(batch_size=batch_size, columns=[task_column]):
            column = batch.column(0).cast(pa.string())
            mask = pc.fill_null(pc.is_in(column, value_set=value_set), False)
            yield np.flatnonzero(mask.to_numpy(zero_copy_only=False)) + offset
            offset += batch.num_rows


def plan_shards(source: Source, rows_per_shard: int, limit: int | None = None,
                task_column: str | None = None, tasks: tuple[str, ...] | None = None) -> list[Shard]:
    if tasks:
        assert task_column is not None
        return plan_filtered(iter_kept_positions(source, task_column, tasks), rows_per_shard, limit)
    return plan_ranges(source.total_rows, rows_per_shard, limit)
