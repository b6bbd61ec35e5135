"""Data layer: read Parquet lazily, plan shards as row ranges, commit outputs atomically."""
from pipeline.data.commit import commit_part, committed_shards, part_stats
from pipeline.data.manifest import read_manifest, write_manifest
from pipeline.data.outputs import STATS_SCHEMA, output_table
from pipeline.data.plan import Shard, plan_shards
from pipeline.data.prompts import build_prompts, check_columns, needed_columns, row_ids
from pipeline.data.read import read_shard
from pipeline.data.source import Source, open_source
from pipeline.data.stats_files import read_stats, write_stats

__all__ = [
    "Shard", "Source", "STATS_SCHEMA", "build_prompts", "check_columns", "commit_part",
    "committed_shards", "needed_columns", "open_source", "output_table", "part_stats",
    "plan_shards", "read_manifest", "read_shard", "read_stats", "row_ids", "write_manifest",
    "write_stats",
]
