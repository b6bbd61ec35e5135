"""infra/: the KubeRay manifests parse, have the parts a GPU run needs, and their entrypoints
are commands the project accepts (Hydra's `--cfg job` on the same overrides succeeds, and the
values pass RunConfig's checks)."""
import shlex
import subprocess
import sys

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from pipeline.config import RunConfig
from pipeline.recipes import CONF_DIR, REPO_ROOT
from pipeline.run import register_resolvers

INFRA = REPO_ROOT / "infra"
COMMAND = ["python", "-m", "pipeline.run"]


def load(name):
    docs = list(yaml.safe_load_all((INFRA / name).read_text()))
    assert len(docs) == 1 and isinstance(docs[0], dict)
    return docs[0]


def cluster_spec(doc):
    return doc["spec"]["rayClusterSpec"] if doc["kind"] == "RayJob" else doc["spec"]


def containers(group):
    return group["template"]["spec"]["containers"]


def overrides_of(entrypoint):
    words = shlex.split(entrypoint)
    assert words[:3] == COMMAND, entrypoint
    return words[3:]


def entrypoints():
    """The RayJob's entrypoint and the `ray job submit ... -- python -m pipeline.run ...`
    command in the RayCluster's comment."""
    found = [load("rayjob.yaml")["spec"]["entrypoint"]]
    text = (INFRA / "raycluster.yaml").read_text().replace("\\\n#", " ")
    for line in text.splitlines():
        if "ray job submit" in line:
            found.append(line.split(" -- ", 1)[1].strip())
    assert len(found) == 2
    return found


@pytest.mark.parametrize("name,kind", [("rayjob.yaml", "RayJob"), ("raycluster.yaml", "RayCluster")])
def test_manifests_parse_with_a_head_and_a_gpu_group(name, kind):
    doc = load(name)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind
    spec = cluster_spec(doc)
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert 8265 in [p["containerPort"] for p in containers(head)[0]["ports"]]
    [gpu] = spec["workerGroupSpecs"]
    limits = containers(gpu)[0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1
    images = {c["image"] for g in [head, gpu] for c in containers(g)}
    assert len(images) == 1                       # head and workers run the same image


def test_rayjob_runs_summarize_and_shuts_down():
    spec = load("rayjob.yaml")["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert isinstance(runtime_env, dict) and runtime_env["env_vars"]["HF_HUB_OFFLINE"] == "1"
    overrides = overrides_of(spec["entrypoint"])
    assert "+job=summarize" in overrides and "cluster.address=auto" in overrides
    workers = spec["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"]
    assert f"cluster.num_actors={workers}" in overrides    # one actor per GPU worker


@pytest.mark.parametrize("index", [0, 1])
def test_entrypoints_are_accepted_by_the_project(index):
    overrides = overrides_of(entrypoints()[index])
    proc = subprocess.run([sys.executable, "-m", "pipeline.run", *overrides, "--cfg", "job"],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["cluster"]["address"] == "auto" and printed["job"]["recipe"] == "generate"
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    run_cfg = RunConfig.from_dict(OmegaConf.to_container(cfg, resolve=True))
    assert run_cfg.output.dir.startswith("s3://")           # outputs outlive the cluster


def test_dockerfile_installs_the_project_beside_its_conf():
    text = (INFRA / "Dockerfile").read_text()
    assert "FROM ${BASE_IMAGE}" in text and "rayproject/ray:" in text
    assert "pip install --no-cache-dir -e ." in text       # conf/ and jobs/ stay beside the package
    for folder in ("pipeline", "conf", "jobs"):
        assert f"COPY --chown=ray:users {folder} ./{folder}" in text
