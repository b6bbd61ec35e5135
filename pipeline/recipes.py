"""Recipe registry: what a job (`conf/job/NAME.yaml`, key `job.recipe`) runs.

A recipe is a function `fn(cfg: DictConfig) -> int | None` (the resolved Hydra config; a
non-zero return is the exit status). `job.recipe` names one of:
- a registered name below (`generate`);
- `module:function`, imported on use;
- `NAME`, meaning `jobs/NAME.py`'s `main` when no registered name matches.
Targets are imported lazily so listing or validating jobs never loads torch or Ray.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any, Callable

from pipeline.config import UserError

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"

RECIPES: dict[str, str] = {
    "generate": "pipeline.cluster.driver:main",   # Ray actor pool over Parquet shards
}


def target_of(recipe: str) -> str:
    """The 'module:function' string a recipe name stands for."""
    if recipe in RECIPES:
        return RECIPES[recipe]
    if ":" in recipe:
        return recipe
    return f"jobs.{recipe}:main"


def resolve(recipe: str) -> Callable[[Any], Any]:
    """Import and return the function behind `recipe`; a clear UserError if it is missing."""
    target = target_of(recipe)
    module_name, _, func_name = target.partition(":")
    if module_name.split(".")[0] == "jobs" and str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))   # jobs/ sits beside the package, not inside it
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            known = ", ".join(sorted(RECIPES))
            raise UserError(f"recipe {recipe!r}: module {module_name!r} not found "
                            f"(registered recipes: {known}; or use 'module:function')") from exc
        raise
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise UserError(f"recipe {recipe!r}: {module_name} has no function {func_name!r}")
    return fn


def list_jobs(conf_dir: Path = CONF_DIR) -> list[tuple[str, str]]:
    """(name, one-line description) for every conf/job/*.yaml, from its first comment line."""
    jobs = []
    for path in sorted((conf_dir / "job").glob("*.yaml")):
        description = ""
        for line in path.read_text().splitlines():
            text = line.lstrip("#").strip()
            if line.startswith("#") and text and not text.startswith("@package"):
                description = text
                break
        jobs.append((path.stem, description))
    return jobs
