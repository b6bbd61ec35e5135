"""The engine as a stage of a user's own Ray Data pipeline (DESIGN.md, "Inside a user's own Ray
Data pipeline"): a thin facade over `Dataset.map_batches` with an actor pool.

    import ray
    from pipeline.ray_data import build_processor

    processor = build_processor(model_path, prompt_column="prompt",
                                sampling=dict(max_new_tokens=64), gamma="auto",
                                concurrency=2, num_gpus=0)
    ds = processor(ray.data.read_parquet(path))     # lazy, like any Ray Data transform
    ds.write_parquet(out)
    processor.stats()       # per actor: acceptance by depth, steps per gamma, tokens/s, tokens

Every input row yields one output row: the input's columns plus `generated_text`,
`finish_reason`, `num_prompt_tokens`, `num_generated_tokens`, `num_drafted_tokens`,
`num_accepted_tokens` and `error` (null when fine), with the pipeline's meaning and types. A row
whose prompt cannot be built or generated (null, empty, too long for the model) gets `error`;
an engine call that raises is narrowed down to the rows that make it raise
(pipeline/cluster/data_stage.py); an actor that dies is restarted by Ray Data and its batch
retried (`max_restarts`, `max_task_retries`). A missing prompt column stops the job.

Speculation stats: each actor exports every batch through `ray.util.metrics` under the
pipeline's metric names (pipeline/cluster/metrics.py; tag `run` = `name`), and reports its
cumulative stats to a small collector actor that this processor owns (created on the first
`processor(ds)`, never detached), read back by `processor.stats()`. Nothing here calls ray.init:
Ray Data (or the user) starts Ray.
"""
from __future__ import annotations

import uuid
from typing import Any, Mapping

from pipeline.config import DataConfig, EngineConfig, ModelConfig, SpecConfig
from pipeline.engine.params import DEFAULT_GAMMA_MAX, SamplingParams

LOADER = "pipeline.cluster.actor:load_engine"


class StatsCollector:
    """The processor's stats mailbox: each stage actor's latest cumulative StageStats."""

    def __init__(self) -> None:
        self.by_actor: dict[str, tuple[dict, Any]] = {}

    def report(self, key: str, info: dict, stats: Any) -> None:
        self.by_actor[key] = (info, stats)

    def get(self) -> dict[str, tuple[dict, Any]]:
        return dict(self.by_actor)


def actor_pool(concurrency: int | tuple[int, int]) -> Any:
    """Ray Data's ActorPoolStrategy: `n` actors, or between `min` and `max` of them."""
    from ray.data import ActorPoolStrategy

    if isinstance(concurrency, int):
        return ActorPoolStrategy(size=concurrency)
    low, high = concurrency
    return ActorPoolStrategy(min_size=low, max_size=high)


class Processor:
    """`processor(ds)` -> ds with the generated columns; `processor.stats()` after it ran."""

    def __init__(self, stage_kwargs: dict, map_kwargs: dict, concurrency: int | tuple[int, int],
                 name: str) -> None:
        self.stage_kwargs, self.map_kwargs, self.name = stage_kwargs, map_kwargs, name
        self.concurrency = concurrency
        self._collector = None

    def __call__(self, ds: Any) -> Any:
        import ray

        from pipeline.cluster.data_stage import GenerateStage

        if self._collector is None:
            self._collector = ray.remote(num_cpus=0)(StatsCollector).remote()
        kwargs = dict(self.stage_kwargs, collector=self._collector, run_name=self.name)
        return ds.map_batches(GenerateStage, fn_constructor_kwargs=kwargs, batch_format="pyarrow",
                              compute=actor_pool(self.concurrency), **self.map_kwargs)

    def stats(self) -> dict:
        """{"actors": [one dict per stage actor: actor_id, node_id, device, batches, num_rows,
        num_errors, num_generated_tokens, num_drafted_tokens, num_accepted_tokens, tokens_per_s,
        acceptance_by_depth, mean_acceptance_length, gamma_steps, generate/draft/verify/host_time_s],
        "total": the same counters over every actor (tokens_per_s: the actors' rates summed)}.
        Covers every batch of every dataset this processor has mapped so far."""
        from pipeline.cluster.stage_stats import StageStats

        if self._collector is None:
            return {"actors": [], "total": StageStats().summary()}
        import ray

        reports = ray.get(self._collector.get.remote())
        actors, total = [], StageStats()
        for info, stats in reports.values():
            actors.append({**info, **stats.summary()})
            total = total.merge(stats)
        summary = total.summary()
        rates = [a["tokens_per_s"] for a in actors if a["tokens_per_s"] is not None]
        summary["tokens_per_s"] = sum(rates) if rates else None
        return {"actors": actors, "total": summary}


def build_processor(model_path: str, prompt_column: str | None = "prompt", template: str | None = None,
                    sampling: SamplingParams | Mapping[str, Any] | None = None, gamma: int | str = "auto",
                    draft: str = "auto", concurrency: int | tuple[int, int] = 1, num_gpus: float = 0,
                    batch_size: int = 64, *, num_cpus: float | None = None, gamma_max: int = DEFAULT_GAMMA_MAX,
                    draft_window: int | None = None,
                    max_batch_size: int = 32, id_column: str | None = None,
                    task_column: str | None = None, device: str = "auto", dtype: str = "auto",
                    allow_pickle: bool = False, max_restarts: int | None = None, loader: Any = LOADER,
                    name: str | None = None, **map_kwargs: Any) -> Processor:
    """A processor mapping a Dataset through an actor pool of engines (one engine per actor).

    model_path: checkpoint folder every node sees, or a URI each node fetches once
    (pipeline/cluster/model_files.py). prompt_column / template: as data.prompt_column /
    data.template (a template such as "Summarize:\\n{text}\\nSummary:" names columns).
    sampling: SamplingParams fields (max_new_tokens, temperature, top_p, top_k, seed, stop,
    truncate_prompt). gamma: 'auto' or an int >= 0, gamma_max caps 'auto'. draft_window: the MTP
    heads read each prompt's last this many tokens (0: all; None: the checkpoint's, as
    spec.draft_window). draft: 'auto',
    'mtp', 'ngram' or 'none', passed to the engine where its generate takes `draft` (which
    checks it; else ignored: the engine drafts with its MTP heads). concurrency: actors (or (min, max));
    num_gpus / num_cpus: per actor (num_cpus defaults to 1 on CPU actors, which run that many
    torch threads, and is left to Ray Data on GPU actors). batch_size: rows per map_batches
    call; max_batch_size: rows the engine decodes together. id_column: keys
    each row's random stream as the pipeline does with data.id_column (without it the prompt's
    text does, so a seeded row samples the same text in any batch). task_column: acceptance
    is tracked per task. loader: 'module:function' or a function (ModelConfig, EngineConfig)
    -> engine. max_restarts: restarts of a dead actor and retries of its batch; None keeps Ray
    Data's default (without limit, so a row that kills every actor it meets is retried for
    ever: set it where that can happen; Ray 2.60 warns that it is passed as a remote arg).
    name: the `run` tag of the exported metrics. map_kwargs go to map_batches (e.g. memory,
    runtime_env)."""
    data = DataConfig(path="<ray.data>", prompt_column=prompt_column, template=template,
                      id_column=id_column, task_column=task_column)
    if template is not None:
        from pipeline.data.prompts import template_fields

        template_fields(template)                          # a bad template fails here, not per row
    if not isinstance(sampling, SamplingParams):
        sampling = SamplingParams(**{k: tuple(v) if isinstance(v, list) else v
                                     for k, v in dict(sampling or {}).items()})
    spec = SpecConfig(gamma=gamma, gamma_max=gamma_max, draft_window=draft_window)
    stage_kwargs = dict(model=ModelConfig(path=str(model_path), device=device, dtype=dtype,
                                          allow_pickle=allow_pickle),
                        engine=EngineConfig(max_batch_size=max_batch_size), data=data,
                        sampling=sampling, gamma=spec.gamma, gamma_max=spec.gamma_max, draft=draft,
                        draft_window=spec.draft_window,
                        num_threads=None if num_gpus else max(1, int(num_cpus or 1)), loader=loader)
    resources = {"num_gpus": num_gpus} if num_gpus else {"num_cpus": num_cpus or 1}
    if num_gpus and num_cpus is not None:
        resources["num_cpus"] = num_cpus
    if max_restarts is not None:
        map_kwargs = {"max_restarts": max_restarts, "max_task_retries": max_restarts, **map_kwargs}
    map_kwargs = {"batch_size": batch_size, **resources, **map_kwargs}
    return Processor(stage_kwargs, map_kwargs, concurrency, name or f"ray_data-{uuid.uuid4().hex[:8]}")
