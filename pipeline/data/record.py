"""The run directory as the driver sees it: plan, committed shards, stats and manifest.

`open_run` plans the shards and checks the directory (fresh, or a resume of the same plan,
config, checkpoint and dataset); `RunRecord.commit` writes one shard's part, then that shard's
stats file, then the manifest, each atomically, so a reader sees a consistent run at any
moment. A commit writes only those three files, of sizes that do not grow with the run, and
the driver keeps running totals, not the shards' stats rows: committing costs the same at any
run size. The manifest's per-shard list is written when the run stops. On resume the stats
come back from the committed parts' metadata, the source of truth.

`output.dir` may be a URI (s3://, gs://, file://; see storage.py). On a cluster the actors
write their parts there themselves and hand back only stats (`RunRecord.mark_committed`);
the driver writes the stats file and the manifest to the same filesystem.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import pyarrow as pa

from pipeline.config import RunConfig, UserError, config_diff
from pipeline.data.commit import (OUTPUTS, clear_run, commit_part, committed_shards, part_name,
                                  part_stats, remove_temp_files)
from pipeline.data.fingerprint import checkpoint_fingerprint, dataset_fingerprint
from pipeline.data.manifest import (now_iso, package_versions, plan_hash, read_manifest,
                                    shard_entries, write_manifest)
from pipeline.data.plan import Shard, plan_shards
from pipeline.data.resume_check import check_same_inputs
from pipeline.data.stats_files import (remove_legacy_stats, remove_stats, stats_files,
                                       write_shard_stats)
from pipeline.data.totals import RunTotals
from pipeline.data.prompts import check_columns
from pipeline.data.source import Source, open_source
from pipeline.data.storage import Store, is_file, open_store


@dataclass
class RunRecord:
    run_dir: Path | str          # a local Path, or the URI as given
    source: Source
    plan: list[Shard]
    manifest: dict[str, Any]
    committed: dict[int, Path | str] = field(default_factory=dict)
    run_totals: RunTotals = field(default_factory=RunTotals)   # committed shards, summed
    attempts: dict[int, int] = field(default_factory=dict)
    session_tokens: int = 0
    session_start: float = field(default_factory=time.perf_counter)
    store: Store | None = None   # run_dir opened on its filesystem

    def __post_init__(self) -> None:
        if self.store is None:
            self.store = open_store(self.run_dir)

    @property
    def output_dir(self) -> str:
        """Where actors commit parts: the absolute local path or the URI."""
        return self.store.root if self.store.is_local else self.store.uri

    @property
    def total_rows(self) -> int:
        return sum(s.num_rows for s in self.plan)

    @property
    def done_rows(self) -> int:
        return sum(s.num_rows for s in self.plan if s.shard_id in self.committed)

    def pending(self) -> list[Shard]:
        return [s for s in self.plan if s.shard_id not in self.committed]

    def commit(self, shard: Shard, table: pa.Table, stats_rows: Sequence[dict]) -> None:
        if table.num_rows != shard.num_rows:
            raise RuntimeError(f"shard {shard.shard_id}: {table.num_rows} output rows for "
                               f"{shard.num_rows} input rows")
        self._committed(shard, commit_part(self.store, shard.shard_id, table, stats_rows), stats_rows)

    def mark_committed(self, shard: Shard, num_rows: int, stats_rows: Sequence[dict]) -> None:
        """Record a part an actor wrote itself; checks the driver can see it."""
        if num_rows != shard.num_rows:
            raise RuntimeError(f"shard {shard.shard_id}: {num_rows} output rows for "
                               f"{shard.num_rows} input rows")
        path = self.store.path(OUTPUTS, part_name(shard.shard_id))
        if not is_file(self.store.fs, path):
            node = next((r.get("node_id") for r in stats_rows if r.get("node_id")), "?")
            raise UserError(f"shard {shard.shard_id} was committed by node {node} but the driver "
                            f"cannot see {path}: on a multi-node cluster output.dir must be shared "
                            "storage (s3://, gs://, or a path every node mounts)")
        self._committed(shard, self.store.show(path), stats_rows)

    def _committed(self, shard: Shard, path: Path | str, stats_rows: Sequence[dict]) -> None:
        self.committed[shard.shard_id] = path
        self.run_totals.observe(stats_rows)
        self.session_tokens += sum(r.get("num_generated_tokens") or 0 for r in stats_rows)
        write_shard_stats(self.store, shard.shard_id, stats_rows)
        self.save("running")

    def committed_stats(self) -> Iterator[dict]:
        """The committed shards' stats rows, read back one shard at a time from the parts'
        metadata (e.g. a resumed run's evidence); the driver does not hold them."""
        for path in self.committed.values():
            yield from part_stats(str(path), self.store.fs)

    def totals(self) -> dict[str, Any]:
        t = self.run_totals.to_dict(self.session_tokens, time.perf_counter() - self.session_start)
        if self.session_tokens == 0:   # a resume with nothing left keeps the last measurement
            t["tokens_per_s"] = self.manifest.get("totals", {}).get("tokens_per_s")
        return t

    def save(self, status: str) -> None:
        self.manifest["status"] = status
        self.manifest["totals"] = self.totals()
        self.manifest["progress"] = {"committed": len(self.committed),
                                     "pending": len(self.plan) - len(self.committed)}
        if status == "running":       # the per-shard list: once, when the run stops
            self.manifest.pop("shards", None)
        else:
            self.manifest["shards"] = shard_entries(self.plan, self.committed, self.attempts)
        write_manifest(self.store, self.manifest)


def open_run(cfg: RunConfig, resolved_config: dict[str, Any]) -> RunRecord:
    """Plan the run and prepare `output.dir`: a fresh directory, resume=true over the same
    plan and config (committed shards are kept and skipped), or overwrite=true (what a previous
    run left there is deleted first). Every input check comes before anything is written."""
    source = open_source(cfg.data.path)
    check_columns(source.schema, cfg.data, cfg.output.keep_columns)
    plan = plan_shards(source, cfg.shards.rows_per_shard, cfg.data.limit,
                       cfg.data.task_column, cfg.data.tasks)
    store = open_store(cfg.output.dir)
    run_dir = Path(store.root) if store.is_local else store.uri
    if cfg.overwrite:
        clear_run(store)
    committed = committed_shards(store)
    previous = read_manifest(store)
    if committed and not cfg.resume:
        raise UserError(f"{run_dir} already holds {len(committed)} committed shard(s); "
                        "pass resume=true to finish that run, overwrite=true to delete it and "
                        "start over, or choose another output.dir")
    inputs = {"checkpoint": checkpoint_fingerprint(cfg.model.path),
              "dataset": dataset_fingerprint(source)}
    if cfg.resume and previous is not None:
        _check_same_run(previous, cfg, plan, run_dir, inputs)
    unknown = sorted(set(committed) - {s.shard_id for s in plan})
    if unknown:
        raise UserError(f"{run_dir} holds parts of shards {unknown} that are not in the plan")
    remove_temp_files(store)
    manifest = {
        "status": "running",
        "started_at": (previous or {}).get("started_at", now_iso()) if cfg.resume else now_iso(),
        "resumed_at": now_iso() if cfg.resume and previous else None,
        "config": resolved_config,
        "config_hash": cfg.hash(),
        "hashed_config": cfg.hashed_dict(),     # what a resume must match (see _check_same_run)
        "versions": package_versions(),
        "data": {"files": len(source.files), "dataset_rows": source.total_rows},
        "plan": {"rows_per_shard": cfg.shards.rows_per_shard, "num_shards": len(plan),
                 "rows": sum(s.num_rows for s in plan), "hash": plan_hash(plan)},
        "inputs": inputs,               # checkpoint and dataset fingerprints (fingerprint.py)
        "totals": (previous or {}).get("totals", {}) if cfg.resume else {},
    }
    record = RunRecord(run_dir, source, plan, manifest, committed=committed, store=store)
    remove_legacy_stats(store)
    have = stats_files(store)
    remove_stats(store, [i for i in have if i not in committed])
    for shard_id, path in committed.items():
        rows = part_stats(str(path), store.fs)
        record.run_totals.observe(rows)
        if shard_id not in have:       # killed between the part and its stats file
            write_shard_stats(store, shard_id, rows)
    record.save("running")
    return record


def _check_same_run(previous: dict, cfg: RunConfig, plan: list[Shard], run_dir: Path,
                    inputs: dict | None = None) -> None:
    if previous.get("config_hash") != cfg.hash():
        changes = config_diff(_previous_settings(previous), cfg.hashed_dict())
        what = "; ".join(changes) if changes else (
            f"hash {previous.get('config_hash')} vs {cfg.hash()}")
        raise UserError(f"resume=true but the config differs from the run in {run_dir}: {what}. "
                        "Resume with that run's settings, choose another output.dir, or pass "
                        "overwrite=true (instead of resume=true) to delete that run and start over")
    check_same_inputs(previous.get("inputs"), inputs or {}, run_dir)
    planned = [{k: e[k] for k in ("shard_id", "start", "stop", "num_rows")}
               for e in previous.get("shards") or []]
    recorded = (previous.get("plan") or {}).get("hash")
    if (recorded and recorded != plan_hash(plan)) or (
            not recorded and planned and planned != [s.to_dict() for s in plan]):
        raise UserError(f"resume=true but the shard plan differs from the run in {run_dir}; "
                        "did the dataset change? (overwrite=true starts over)")


def _previous_settings(previous: dict) -> dict:
    """The output-affecting settings a run directory's manifest records (older manifests hold
    only the resolved config, from which they are rebuilt); {} when neither is readable."""
    if isinstance(previous.get("hashed_config"), dict):
        return previous["hashed_config"]
    try:
        return RunConfig.from_dict(previous.get("config") or {}).hashed_dict()
    except (ValueError, TypeError, KeyError):
        return {}
