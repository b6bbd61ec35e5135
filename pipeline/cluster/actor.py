"""The Ray actor: loads the engine once, then processes shards handed to it.

A thin wrapper over `worker.process_shard`; all Ray specifics (runtime context, resources)
stay here and in pool.py.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import ray

from pipeline.config import EngineConfig, ModelConfig
from pipeline.cluster.model_files import model_on_node
from pipeline.cluster.worker import ShardResult, ShardTask, commit_result, process_shard


def load_engine(model: ModelConfig, engine: EngineConfig) -> Any:
    """The default loader: `Engine.from_pretrained` with the configured device and dtype."""
    from pipeline.engine import Engine

    return Engine.from_pretrained(model.path, device=model.device, dtype=model.dtype,
                                  max_batch_size=engine.max_batch_size,
                                  allow_pickle=model.allow_pickle)


Loader = Callable[[ModelConfig, EngineConfig], Any]


def _import(target: str | Loader) -> Loader:
    if callable(target):
        return target
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


class ShardWorker:
    """One actor = one engine. `loader` ('module:function' or a function of (model, engine))
    builds the engine; the default is `load_engine`."""

    def __init__(self, model: ModelConfig, engine: EngineConfig, num_threads: int | None = None,
                 loader: str | Loader = "pipeline.cluster.actor:load_engine") -> None:
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)
        ctx = ray.get_runtime_context()
        node = f"{ray.util.get_node_ip_address()} (node_id {ctx.get_node_id()})"
        model = dataclasses.replace(model, path=model_on_node(model.path, node))
        self.engine = _import(loader)(model, engine)
        device = getattr(self.engine, "device", None)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.priors: dict = {}        # task -> acceptance counters from this actor's earlier shards
        self.info = {"actor_id": ctx.get_actor_id(), "node_id": ctx.get_node_id(),
                     "device": str(device), "threads": torch.get_num_threads()}

    def ready(self) -> dict:
        return self.info

    def run(self, task: ShardTask) -> ShardResult:
        """Generate the shard; with task.output_dir set, commit its part here and return stats."""
        return commit_result(task, process_shard(self.engine, task, self.info, self.priors))


def actor_options(use_gpus: bool, gpus_per_actor: float, cpus_per_actor: int) -> dict:
    """Ray resources of one actor: GPUs where the cluster has them, else CPUs."""
    if use_gpus:
        return {"num_gpus": gpus_per_actor, "num_cpus": 1, "max_restarts": 0}
    return {"num_gpus": 0, "num_cpus": cpus_per_actor, "max_restarts": 0}


def start_actor(model: ModelConfig, engine: EngineConfig, options: dict,
                loader: str | Loader = "pipeline.cluster.actor:load_engine") -> Any:
    threads = None if options.get("num_gpus") else int(options["num_cpus"])
    remote_cls = ray.remote(ShardWorker).options(**options)
    return remote_cls.remote(model, engine, threads, loader)
