"""Validated run configuration: frozen dataclasses built from the Hydra config.

These dataclasses hold every key's default and are the Hydra schema (pipeline.run registers
them with Hydra's ConfigStore), so `conf/config.yaml` and the jobs set only what differs.
Each section checks its own ranges in `__post_init__` and raises `ConfigError` with the key's
full name, so a bad override fails before any work starts. The `sampling` section is the
engine's own `SamplingParams`. No I/O happens here (paths are checked by the code that opens them).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from pipeline.engine.params import DEFAULT_GAMMA_MAX, DRAFT_CHOICES, SamplingParams


class ConfigError(ValueError):
    """A configuration value is out of range or of the wrong kind."""


class UserError(RuntimeError):
    """A problem the user can fix (missing file, bad path); printed without a traceback."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""                 # HF checkpoint directory (config.json + safetensors)
    device: str = "auto"           # auto (cuda where present, else cpu) | cpu | cuda | cuda:N
    dtype: str = "auto"            # auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16 | float16
    allow_pickle: bool = False     # load *.bin/*.pt weights (weights_only) when there are no
                                   # safetensors; pickle can run code: only checkpoints you trust

    def __post_init__(self) -> None:
        _check(isinstance(self.path, str) and self.path != "", "model.path must be a non-empty path")
        _check(isinstance(self.allow_pickle, bool),
               f"model.allow_pickle must be true or false, got {self.allow_pickle!r}")
        _check(self.device == "auto" or self.device == "cpu" or str(self.device).startswith("cuda"),
               f"model.device must be auto, cpu or cuda[:N], got {self.device!r}")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"),
               f"model.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass(frozen=True)
class DataConfig:
    path: str = ""                           # Parquet file, directory or glob
    prompt_column: str | None = "prompt"     # column holding the prompt text (used when template is null)
    template: str | None = None              # format string over the row's columns, e.g. "Summarize:\n{text}\nSummary:"
    id_column: str | None = None             # null: id = the row's position in the dataset
    task_column: str | None = None           # column naming each row's task (acceptance per task); null: one task
    tasks: tuple[str, ...] | None = None     # keep only rows whose task is listed (needs task_column)
    limit: int | None = None                 # only the first N (kept) rows

    def __post_init__(self) -> None:
        _check(isinstance(self.path, str) and self.path != "",
               "data.path is required: a Parquet file, a directory of them, or a glob")
        _check(self.template is not None or bool(self.prompt_column),
               "set data.prompt_column or data.template")
        if self.template is not None:
            _check(isinstance(self.template, str) and self.template != "",
                   "data.template must be a non-empty string or null")
        _check(self.limit is None or (_is_int(self.limit) and self.limit > 0),
               f"data.limit must be null or an int > 0, got {self.limit!r}")
        if self.tasks is not None:
            _check(self.task_column is not None, "data.tasks needs data.task_column")
            _check(len(self.tasks) > 0, "data.tasks must be null or a non-empty list")
            object.__setattr__(self, "tasks", tuple(str(t) for t in self.tasks))


@dataclass(frozen=True)
class OutputConfig:
    dir: str = ""                            # run directory: a path or a URI (s3://, gs://, file://)
    keep_columns: tuple[str, ...] = ()       # input columns copied to the outputs

    def __post_init__(self) -> None:
        _check(isinstance(self.dir, str) and self.dir != "", "output.dir must be a non-empty path")
        object.__setattr__(self, "keep_columns", tuple(str(c) for c in self.keep_columns))
        reserved = set(OUTPUT_COLUMNS) & set(self.keep_columns)
        _check(not reserved, f"output.keep_columns clash with output columns: {sorted(reserved)}")


@dataclass(frozen=True)
class SpecConfig:
    gamma: int | str = "auto"     # drafts per verify step: 'auto' (chosen per shard) or an int >= 0 (0 = none)
    gamma_max: int = DEFAULT_GAMMA_MAX   # caps 'auto'
    prior: str | None = None      # a run directory (or a spec_prior.json) whose acceptance starts the plans
    draft: str = "auto"           # draft sources: 'auto' (per row, the source that pays), 'mtp', 'ngram', 'none'
    draft_window: int | None = None   # MTP heads read each prompt's last N tokens (0: all); null: the checkpoint's draft_window.json

    def __post_init__(self) -> None:
        _check(self.draft in DRAFT_CHOICES,
               f"spec.draft must be one of {', '.join(DRAFT_CHOICES)}, got {self.draft!r}")
        _check(_is_int(self.gamma_max) and self.gamma_max >= 0,
               f"spec.gamma_max must be an int >= 0, got {self.gamma_max!r}")
        _check(self.draft_window is None or (_is_int(self.draft_window) and self.draft_window >= 0),
               f"spec.draft_window must be null or an int >= 0, got {self.draft_window!r}")
        if self.gamma != "auto":
            _check(_is_int(self.gamma) and self.gamma >= 0,
                   f"spec.gamma must be 'auto' or an int >= 0, got {self.gamma!r}")


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32      # rows decoded together by one actor (continuous batching)

    def __post_init__(self) -> None:
        _check(_is_int(self.max_batch_size) and self.max_batch_size > 0,
               f"engine.max_batch_size must be an int > 0, got {self.max_batch_size!r}")


@dataclass(frozen=True)
class ShardsConfig:
    rows_per_shard: int = 256     # rows per shard; one shard = one output file
    max_attempts: int = 3         # tries per shard (actor failures) before its rows are written as errors

    def __post_init__(self) -> None:
        _check(_is_int(self.rows_per_shard) and self.rows_per_shard > 0,
               f"shards.rows_per_shard must be an int > 0, got {self.rows_per_shard!r}")
        _check(_is_int(self.max_attempts) and self.max_attempts > 0,
               f"shards.max_attempts must be an int > 0, got {self.max_attempts!r}")


@dataclass(frozen=True)
class ClusterConfig:
    address: str | None = None    # null: start Ray in-process; 'auto' or an address: join
    num_actors: int = 1           # actors in the pool; each loads the model once
    gpus_per_actor: float = 1     # GPUs per actor where CUDA is present
    cpus_per_actor: int = 2       # CPUs per actor without GPUs (torch threads are set to match)

    def __post_init__(self) -> None:
        _check(self.address is None or (isinstance(self.address, str) and self.address != ""),
               f"cluster.address must be null, 'auto' or an address, got {self.address!r}")
        _check(_is_int(self.num_actors) and self.num_actors > 0,
               f"cluster.num_actors must be an int > 0, got {self.num_actors!r}")
        _check(isinstance(self.gpus_per_actor, (int, float)) and self.gpus_per_actor > 0,
               f"cluster.gpus_per_actor must be > 0, got {self.gpus_per_actor!r}")
        _check(_is_int(self.cpus_per_actor) and self.cpus_per_actor > 0,
               f"cluster.cpus_per_actor must be an int > 0, got {self.cpus_per_actor!r}")


@dataclass(frozen=True)
class JobConfig:
    name: str | None = None       # set by conf/job/NAME.yaml
    recipe: str | None = None     # registered recipe name or 'module:function'


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    data: DataConfig
    output: OutputConfig
    spec: SpecConfig = field(default_factory=SpecConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    engine: EngineConfig = field(default_factory=EngineConfig)
    shards: ShardsConfig = field(default_factory=ShardsConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    job: JobConfig = field(default_factory=JobConfig)
    resume: bool = False          # skip the shards already committed under output.dir (same config)
    overwrite: bool = False       # delete what a previous run left in output.dir and start over

    def __post_init__(self) -> None:
        _check(isinstance(self.resume, bool), f"resume must be true or false, got {self.resume!r}")
        _check(isinstance(self.overwrite, bool),
               f"overwrite must be true or false, got {self.overwrite!r}")
        _check(not (self.resume and self.overwrite),
               "resume=true keeps a run's shards and overwrite=true deletes them: pass one")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "RunConfig":
        """Build from a plain dict (e.g. `OmegaConf.to_container(cfg, resolve=True)`).

        Top-level sections not named here (a job's own settings) are ignored; an unknown key
        inside a known section is an error, so typos do not pass silently.
        """
        sections = {}
        for f in dataclasses.fields(cls):
            if f.name in _FLAGS:
                continue
            section_cls = SECTIONS[f.name]
            values = dict(raw.get(f.name) or {})
            known = {sf.name for sf in dataclasses.fields(section_cls)}
            unknown = sorted(set(values) - known)
            _check(not unknown, f"unknown key(s) {', '.join(f'{f.name}.{k}' for k in unknown)}; "
                                f"known: {', '.join(sorted(known))}")
            for key, value in values.items():
                if isinstance(value, list):
                    values[key] = tuple(value)
            try:
                sections[f.name] = section_cls(**values)
            except ConfigError:
                raise
            except ValueError as exc:  # SamplingParams' own check: its message starts with the field
                raise ConfigError(f"{f.name}.{exc}") from exc
            except TypeError as exc:  # wrong value kind that dataclass itself rejects
                raise ConfigError(f"{f.name}: {exc}") from exc
        return cls(**{k: raw.get(k, False) for k in _FLAGS}, **sections)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hashed_dict(self) -> dict[str, Any]:
        """The settings that affect the outputs (not output.dir, resume, overwrite, cluster, job,
        model.allow_pickle, spec.prior, spec.draft_window). Keys added later are left out at their
        defaults, so a run directory written before they existed still resumes."""
        d = self.to_dict()
        for key in (*_FLAGS, "cluster", "job"):
            d.pop(key, None)
        d["output"].pop("dir", None)
        d["model"].pop("allow_pickle", None)
        d["spec"].pop("prior", None)             # evidence to start from: gamma only, never the outputs
        d["spec"].pop("draft_window", None)      # what the heads read: drafts only, never the outputs
        for section, key, default in _ADDED_LATER:
            if d[section].get(key) == default:
                d[section].pop(key)
        return json.loads(json.dumps(d, default=str))

    def hash(self) -> str:
        """Short hash of `hashed_dict()`: a resume must match it."""
        blob = json.dumps(self.hashed_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """What differs between two nested dicts, one 'key: old -> new' per leaf, e.g.
    config_diff({"sampling": {"seed": 0}}, {"sampling": {"seed": 7}}) == ["sampling.seed: 0 -> 7"].
    A key only one side has shows as '(unset)' on the other."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b = old.get(key, _UNSET), new.get(key, _UNSET)
        name = f"{prefix}{key}"
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_diff(a, b, f"{name}.")
        elif a != b:
            out.append(f"{name}: {_show(a)} -> {_show(b)}")
    return out


_UNSET = object()


def _show(value: Any) -> str:
    return "(unset)" if value is _UNSET else repr(value)


_FLAGS = ("resume", "overwrite")        # top-level run flags; not sections
_ADDED_LATER = (("sampling", "truncate_prompt", False), ("sampling", "ignore_eos", False),
                ("sampling", "verify", "coupled"))


SECTIONS = {                            # section name -> its dataclass (also the Hydra schema)
    "model": ModelConfig, "data": DataConfig, "output": OutputConfig, "spec": SpecConfig,
    "sampling": SamplingParams, "engine": EngineConfig, "shards": ShardsConfig,
    "cluster": ClusterConfig, "job": JobConfig,
}

OUTPUT_COLUMNS = (
    "id", "prompt", "generated_text", "finish_reason", "num_prompt_tokens",
    "num_generated_tokens", "num_drafted_tokens", "num_accepted_tokens", "error",
)
