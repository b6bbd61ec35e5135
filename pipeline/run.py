"""Hydra entry: `python -m pipeline.run +job=NAME [key=value ...]`.

`+job=NAME` merges `conf/job/NAME.yaml` over `conf/config.yaml`, which merges over the schema
built from pipeline/config.py's dataclasses (`register_schema`: every key, its type and its
default); `job.recipe` names what runs (see pipeline/recipes.py). The run directory is
`output.dir`; Hydra keeps its own files in `output.dir/.hydra` and never changes the working
directory. Without `+job` this prints the
available jobs.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from pipeline.config import SECTIONS, ConfigError, RunConfig, UserError
from pipeline.data.storage import hydra_dir
from pipeline.recipes import list_jobs, resolve

PACKAGE_DIR = Path(__file__).resolve().parent
_HYDRA_FLAGS = ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info",
                "--shell-completion", "-sc", "--version")


def register_resolvers() -> None:
    """`${asset:demo/model}` -> absolute path under pipeline/assets (works from any cwd);
    `${hydra_dir:${output.dir}}` -> a local folder for Hydra's files (output.dir may be s3://)."""
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", lambda rel: str(PACKAGE_DIR / "assets" / rel))
    if not OmegaConf.has_resolver("hydra_dir"):
        OmegaConf.register_new_resolver("hydra_dir", hydra_dir)


def schema() -> dict:
    """The Hydra schema of RunConfig: one typed node per section, from its dataclass (with its
    defaults), and the top-level flags. Nodes are left writable (a frozen dataclass would make
    them read-only, and a job could not override them) and the root is a plain dict, so a job
    may add sections of its own (`bench:`, `mtp:`)."""
    nodes: dict = {}
    for f in dataclasses.fields(RunConfig):
        section = SECTIONS.get(f.name)
        if section is None:                       # a top-level flag: resume, overwrite
            nodes[f.name] = f.default
            continue
        node = OmegaConf.structured(section)
        OmegaConf.set_readonly(node, False)
        nodes[f.name] = node
    return nodes


def register_schema() -> None:
    """Register `schema()` as the config `run_schema`, the first entry of conf/config.yaml's
    defaults list."""
    ConfigStore.instance().store(name="run_schema", node=schema())


def usage() -> str:
    lines = ["usage: python -m pipeline.run +job=NAME [key=value ...]", "", "jobs:"]
    jobs = list_jobs()
    width = max((len(name) for name, _ in jobs), default=0)
    lines += [f"  {name.ljust(width)}  {description}" for name, description in jobs]
    if not jobs:
        lines.append("  (none found in conf/job/)")
    lines += ["", "example: python -m pipeline.run +job=summarize data.limit=20 spec.gamma=3",
              "show the resolved config: python -m pipeline.run +job=summarize --cfg job"]
    return "\n".join(lines)


def _names_a_job(argv: list[str]) -> bool:
    return any(a.split("=")[0].lstrip("+~") == "job" for a in argv)


def run_recipe(cfg: DictConfig) -> int:
    """Run the job's recipe; user-fixable problems become a message and exit status 1."""
    recipe = OmegaConf.select(cfg, "job.recipe")
    if not recipe:
        print(usage(), file=sys.stderr)
        return 2
    try:
        return int(resolve(recipe)(cfg) or 0)
    except (UserError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


register_resolvers()
register_schema()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    status = run_recipe(cfg)
    if status:
        sys.exit(status)


def main() -> None:
    argv = sys.argv[1:]
    if not _names_a_job(argv) and not any(a in _HYDRA_FLAGS for a in argv):
        print(usage(), file=sys.stderr)
        sys.exit(2)
    _hydra_main()


if __name__ == "__main__":
    main()
