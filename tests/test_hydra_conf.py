"""Every conf/job/*.yaml composes with conf/config.yaml and validates."""
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline.config import RunConfig
from pipeline.recipes import CONF_DIR, REPO_ROOT, RECIPES, list_jobs, resolve, target_of
from pipeline.run import register_resolvers

JOBS = [name for name, _ in list_jobs()]


def compose_job(name, overrides=()):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=[f"+job={name}", *overrides],
                       return_hydra_config=False)


def test_there_are_jobs():
    assert "summarize" in JOBS


REQUIRED = {"generate": ["data.path=questions.parquet", "data.prompt_column=question"]}  # what the job requires


@pytest.mark.parametrize("name", JOBS)
def test_job_composes(name):
    cfg = compose_job(name, REQUIRED.get(name, ()))
    assert cfg.job.name == name
    assert cfg.job.recipe, f"conf/job/{name}.yaml must set job.recipe"
    assert callable(resolve(cfg.job.recipe))   # the recipe exists and imports
    raw = OmegaConf.to_container(cfg, resolve=True)
    if target_of(cfg.job.recipe) == RECIPES["generate"]:
        RunConfig.from_dict(raw)   # generation jobs must validate as a whole
    text = (CONF_DIR / "job" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_")


def test_base_config_has_every_design_key():
    cfg = compose_job("summarize")
    for key in ["model.path", "model.device", "model.dtype", "data.path", "data.prompt_column",
                "data.template", "data.id_column", "data.task_column", "data.limit",
                "output.dir", "output.keep_columns", "spec.gamma", "spec.gamma_max",
                "sampling.max_new_tokens", "sampling.temperature", "sampling.top_p",
                "sampling.top_k", "sampling.seed", "sampling.stop", "engine.max_batch_size",
                "shards.rows_per_shard", "cluster.address", "cluster.num_actors",
                "cluster.gpus_per_actor", "cluster.cpus_per_actor", "resume"]:
        assert OmegaConf.select(cfg, key, default="MISSING") != "MISSING", key


def test_overrides_reach_the_validated_config():
    cfg = compose_job("summarize", ["spec.gamma=3", "data.limit=7", "spec.draft_window=16"])
    run = RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    assert run.spec.gamma == 3 and run.data.limit == 7 and run.spec.draft_window == 16
    assert RunConfig.from_dict(OmegaConf.to_container(compose_job("summarize"), resolve=True)).spec.draft_window is None
    assert run.model.path.endswith("assets/demo/model")


def test_without_job_prints_the_job_list():
    proc = subprocess.run([sys.executable, "-m", "pipeline.run"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "+job=NAME" in proc.stderr
    for name in JOBS:
        assert name in proc.stderr


def test_recipe_names_resolve_by_registry_path_or_convention():
    assert target_of("generate") == "pipeline.recipes:generate"
    assert target_of("pkg.mod:fn") == "pkg.mod:fn"
    assert target_of("build_demo") == "jobs.build_demo:main"


def test_yaml_defaults_are_the_dataclass_defaults():
    """The schema comes from pipeline/config.py: conf/config.yaml sets only the paths, so every
    other key's value is its dataclass default (they cannot drift apart)."""
    import dataclasses

    from pipeline.config import SECTIONS

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        raw = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    set_by_yaml = {"model.path", "data.path", "output.dir"}
    for name, section in SECTIONS.items():
        for f in dataclasses.fields(section):
            key = f"{name}.{f.name}"
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            if key not in set_by_yaml:
                assert raw[name][f.name] == (list(default) if isinstance(default, tuple) else default), key
    assert raw["cluster"]["cpus_per_actor"] == 2 and raw["resume"] is False
    assert RunConfig.from_dict(raw).sampling.max_new_tokens == 64


def test_a_job_overrides_schema_keys_and_adds_its_own_sections():
    cfg = compose_job("bench_quick", ["spec.gamma_max=7"])
    assert cfg.spec.gamma_max == 7 and list(cfg.bench.batches) == [1, 8]
    with pytest.raises(Exception, match="gama"):
        compose_job("summarize", ["spec.gama=3"])         # a typo in a schema section is an error
