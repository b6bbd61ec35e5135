"""Recipe registry: what a job (`conf/job/NAME.yaml`, key `job.recipe`) runs.

A recipe is a function `fn(cfg: DictConfig) -> int | None` (the resolved Hydra config; a
non-zero return is the exit status). `job.recipe` names one of:
- a registered name below (`generate`: the driver runs the shards, then the dashboard is drawn);
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
    "generate": "pipeline.recipes:generate",   # Ray actor pool over Parquet shards, then report.html
}


def generate(cfg: Any) -> int:
    """Recipe `generate`: check the inputs and open the run (nothing is written when they are
    wrong), run the shards (pipeline.cluster.driver), then write RUN_DIR/report.html
    (pipeline.dashboard), however the run ended."""
    from pipeline.cluster.driver import open_job, run_job

    run_cfg, record = open_job(cfg)
    try:
        return run_job(run_cfg, record)
    finally:
        write_dashboard(record.run_dir)


def write_dashboard(run_dir: Any) -> None:
    """RUN_DIR/report.html where RUN_DIR holds a run (a manifest); a failure is reported as a
    warning and never fails the run."""
    try:
        from pipeline.dashboard import write_report
        from pipeline.data.manifest import read_manifest

        if read_manifest(run_dir) is not None:
            write_report(run_dir)
    except Exception as exc:
        print(f"warning: could not write the dashboard report.html in {run_dir}: {exc}",
              file=sys.stderr)


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
