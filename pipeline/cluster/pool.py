"""A pool of ShardWorker actors that takes shards as actors become free.

Tries go to whichever actor is idle, so a fast actor takes more. What follows a try that
failed (its actor died, or its task raised) is the caller's choice (narrow.py: retry, then
narrow down to the bad rows, then give up); an actor that died is replaced. If tries keep
failing (more in a row than narrowing down explains) the run stops instead, for a later resume.
"""
from __future__ import annotations

import re
from collections import deque
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError

from pipeline.config import UserError
from pipeline.cluster.narrow import Try
from pipeline.cluster.worker import ShardResult, ShardTask


def start_error(text: str) -> str:
    """An actor's start failure as one message: the UserError it raised (e.g. 'node ... cannot
    see model.path ...') without Ray's traceback wrapper, else Ray's whole text."""
    for line in reversed(text.splitlines()):
        m = re.search(r"\b(?:UserError|ModelNotVisible): (.+)$", line)
        if m:
            return m.group(1)
    return f"an actor could not start (model loading failed?): {text}"


class ActorsKeepDying(RuntimeError):
    """More failed tries in a row than the pool tolerates; the run stops and can be resumed."""


class ActorPool:
    """`max_failures_in_a_row`: failed tries (actor deaths or tasks that raised) with no
    success between them after which `run` raises ActorsKeepDying (see narrow.py)."""

    def __init__(self, spawn: Callable[[], Any], size: int, max_failures_in_a_row: int) -> None:
        self.spawn = spawn
        self.actors = [spawn() for _ in range(size)]
        self.max_failures_in_a_row = max_failures_in_a_row
        self.failures_in_a_row = 0
        self.deaths = 0

    def wait_ready(self) -> list[dict]:
        """Block until every actor has loaded its engine; a load failure is a UserError."""
        try:
            return ray.get([a.ready.remote() for a in self.actors])
        except RayActorError as exc:
            raise UserError(start_error(str(exc))) from exc

    def replace(self, actor: Any) -> Any:
        self.deaths += 1
        ray.kill(actor, no_restart=True)
        fresh = self.spawn()
        self.actors = [fresh if a is actor else a for a in self.actors]
        return fresh

    def run(self, tries: list[Try], make_task: Callable[[Try, Any], ShardTask],
            on_done: Callable[[Try, ShardResult], list[Try]],
            on_failed: Callable[[Try, str], list[Try]]) -> None:
        """Run every try on whichever actor is idle (`make_task(try, actor)`: the task is made for
        the actor that takes it); the callbacks return the tries that follow
        (retries first in line). A dead actor is replaced; a UserError raised in a task (the
        input cannot be read) stops the run."""
        queue = deque(tries)
        idle = list(self.actors)
        running: dict[Any, tuple[Any, Try]] = {}
        while queue or running:
            while idle and queue:
                t = queue.popleft()
                actor = idle.pop()
                running[actor.run.remote(make_task(t, actor))] = (actor, t)
            [ref], _ = ray.wait(list(running), num_returns=1)
            actor, t = running.pop(ref)
            try:
                result = ray.get(ref)
            except RayActorError as exc:
                idle.append(self.replace(actor))
                failure = f"actor died on attempt {t.attempt}: {exc}"
            except UserError as exc:   # Ray re-raises the task's exception as its own type
                raise UserError(str(getattr(exc, "cause", None) or exc)) from None
            except Exception as exc:  # the task raised inside a live actor
                idle.append(actor)
                failure = f"attempt {t.attempt} raised: {exc}"
            else:
                idle.append(actor)
                self.failures_in_a_row = 0
                queue.extend(on_done(t, result))
                continue
            self.failures_in_a_row += 1
            if self.failures_in_a_row > self.max_failures_in_a_row:
                raise ActorsKeepDying(f"{self.failures_in_a_row} tries failed in a row (the last: "
                                      f"{failure[:300]}); stopping (resume=true continues)")
            queue.extendleft(reversed(on_failed(t, failure)))

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
