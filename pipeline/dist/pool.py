"""A pool of ShardWorker actors that takes shards as actors become free.

Shards go to whichever actor is idle, so a fast actor takes more. A shard whose actor died or
whose task raised is tried again (up to `max_attempts`); an actor that died is replaced. A
shard that fails every attempt is handed to `on_give_up`, which writes its rows with the
error, so no row is dropped. If actors keep dying (more deaths than the pool could plausibly
survive) the run stops instead, uncommitted, for a later resume.
"""
from __future__ import annotations

import re
from collections import deque
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError

from pipeline.config import UserError
from pipeline.data.plan import Shard
from pipeline.dist.worker import ShardResult, ShardTask


def start_error(text: str) -> str:
    """An actor's start failure as one message: the UserError it raised (e.g. 'node ... cannot
    see model.path ...') without Ray's traceback wrapper, else Ray's whole text."""
    for line in reversed(text.splitlines()):
        m = re.search(r"\b(?:UserError|ModelNotVisible): (.+)$", line)
        if m:
            return m.group(1)
    return f"an actor could not start (model loading failed?): {text}"


class ActorsKeepDying(RuntimeError):
    """More actor deaths than the pool tolerates; the run stops and can be resumed."""


class ActorPool:
    def __init__(self, spawn: Callable[[], Any], size: int, max_deaths: int) -> None:
        self.spawn = spawn
        self.actors = [spawn() for _ in range(size)]
        self.max_deaths = max_deaths
        self.deaths = 0

    def wait_ready(self) -> list[dict]:
        """Block until every actor has loaded its engine; a load failure is a UserError."""
        try:
            return ray.get([a.ready.remote() for a in self.actors])
        except RayActorError as exc:
            raise UserError(start_error(str(exc))) from exc

    def replace(self, actor: Any) -> Any:
        self.deaths += 1
        if self.deaths > self.max_deaths:
            raise ActorsKeepDying(f"{self.deaths} actors died; stopping (resume=true continues)")
        ray.kill(actor, no_restart=True)
        fresh = self.spawn()
        self.actors = [fresh if a is actor else a for a in self.actors]
        return fresh

    def run(self, shards: list[Shard], make_task: Callable[[Shard, int], ShardTask],
            on_done: Callable[[Shard, int, ShardResult], None],
            on_give_up: Callable[[Shard, int, str], None], max_attempts: int) -> None:
        queue = deque((shard, 1) for shard in shards)
        idle = list(self.actors)
        running: dict[Any, tuple[Any, Shard, int]] = {}
        while queue or running:
            while idle and queue:
                shard, attempt = queue.popleft()
                actor = idle.pop()
                running[actor.run.remote(make_task(shard, attempt))] = (actor, shard, attempt)
            [ref], _ = ray.wait(list(running), num_returns=1)
            actor, shard, attempt = running.pop(ref)
            try:
                result = ray.get(ref)
            except RayActorError as exc:
                idle.append(self.replace(actor))
                failure = f"actor died on attempt {attempt}: {exc}"
            except Exception as exc:  # the task raised inside a live actor
                idle.append(actor)
                failure = f"attempt {attempt} raised: {exc}"
            else:
                idle.append(actor)
                on_done(shard, attempt, result)
                continue
            if attempt < max_attempts:
                queue.appendleft((shard, attempt + 1))
            else:
                on_give_up(shard, attempt, failure)

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
