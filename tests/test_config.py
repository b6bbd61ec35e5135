"""pipeline/config.py: ranges are checked with the key's name in the message."""
import pytest

from pipeline.config import ConfigError, RunConfig


def base(**overrides):
    raw = {
        "model": {"path": "m"},
        "data": {"path": "d.parquet"},
        "output": {"dir": "runs/x"},
    }
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        raw.setdefault(section, {})[key] = value
    return raw


def test_defaults_build():
    cfg = RunConfig.from_dict(base())
    assert cfg.spec.gamma == "auto"
    assert cfg.sampling.verify == "coupled"
    assert cfg.engine.max_batch_size > 0
    assert cfg.resume is False


@pytest.mark.parametrize("key,value,needle", [
    ("spec__gamma", -1, "spec.gamma"),
    ("spec__gamma", "sometimes", "spec.gamma"),
    ("spec__gamma_max", -2, "spec.gamma_max"),
    ("spec__draft_window", -1, "spec.draft_window"),
    ("spec__draft_window", "last", "spec.draft_window"),
    ("engine__max_batch_size", 0, "engine.max_batch_size"),
    ("shards__rows_per_shard", 0, "shards.rows_per_shard"),
    ("sampling__temperature", -0.5, "sampling.temperature"),
    ("sampling__top_p", 0.0, "sampling.top_p"),
    ("sampling__top_k", -1, "sampling.top_k"),
    ("sampling__max_new_tokens", 0, "sampling.max_new_tokens"),
    ("sampling__verify", "maximal", "sampling.verify"),
    ("data__limit", 0, "data.limit"),
    ("data__tasks", ["a"], "data.task_column"),
    ("cluster__num_actors", 0, "cluster.num_actors"),
    ("cluster__cpus_per_actor", 0, "cluster.cpus_per_actor"),
    ("model__dtype", "int3", "model.dtype"),
    ("output__keep_columns", ["id"], "keep_columns"),
])
def test_bad_values_are_rejected_with_the_key_name(key, value, needle):
    with pytest.raises(ConfigError, match=needle):
        RunConfig.from_dict(base(**{key: value}))


def test_unknown_key_is_an_error():
    with pytest.raises(ConfigError, match="spec.gama"):
        RunConfig.from_dict(base(spec__gama=3))


def test_boolean_is_not_an_int():
    with pytest.raises(ConfigError, match="spec.gamma"):
        RunConfig.from_dict(base(spec__gamma=True))


def test_gamma_int_and_lists_become_tuples():
    cfg = RunConfig.from_dict(base(spec__gamma=0, sampling__stop=["\n\n"],
                                   data__task_column="task", data__tasks=["a", "b"]))
    assert cfg.spec.gamma == 0
    assert cfg.sampling.stop == ("\n\n",)
    assert cfg.data.tasks == ("a", "b")


def test_hash_ignores_run_dir_and_cluster_but_not_sampling():
    a = RunConfig.from_dict(base())
    b = RunConfig.from_dict(base(output__dir="elsewhere", cluster__num_actors=4))
    c = RunConfig.from_dict(base(sampling__seed=1))
    assert a.hash() == b.hash()
    assert a.hash() != c.hash()


def test_hash_of_a_config_without_the_newer_keys_is_unchanged():
    import hashlib
    import json

    cfg = RunConfig.from_dict(base(sampling__seed=3))
    d = cfg.to_dict()                                       # the hash as runs before these keys wrote it
    for key in ("resume", "overwrite", "cluster", "job"):
        d.pop(key)
    d["output"].pop("dir")
    d["model"].pop("allow_pickle")
    d["sampling"].pop("truncate_prompt")
    d["sampling"].pop("ignore_eos")
    d["sampling"].pop("verify")
    d["spec"].pop("prior")                                  # evidence to start from, never hashed
    d["spec"].pop("draft_window")                           # what the heads read, likewise
    old = hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]
    assert cfg.hash() == old
    assert RunConfig.from_dict(base(sampling__truncate_prompt=True)).hash() != RunConfig.from_dict(base()).hash()
    assert RunConfig.from_dict(base(sampling__verify="rejection")).hash() != RunConfig.from_dict(base()).hash()
    assert RunConfig.from_dict(base(model__allow_pickle=True)).hash() == RunConfig.from_dict(base()).hash()
    assert RunConfig.from_dict(base(spec__prior="runs/x")).hash() == RunConfig.from_dict(base()).hash()
    assert RunConfig.from_dict(base(spec__draft_window=64)).hash() == RunConfig.from_dict(base()).hash()


def test_config_diff_names_each_change():
    from pipeline.config import config_diff

    a = RunConfig.from_dict(base()).hashed_dict()
    b = RunConfig.from_dict(base(sampling__seed=7, data__template="Q: {q}", model__path="other")).hashed_dict()
    assert config_diff(a, b) == ["data.template: None -> 'Q: {q}'", "model.path: 'm' -> 'other'",
                                 "sampling.seed: 0 -> 7"]
    assert config_diff({"x": {"y": 1}}, {"x": {}}) == ["x.y: 1 -> (unset)"]


def test_resume_and_overwrite_exclude_each_other():
    raw = base()
    with pytest.raises(ConfigError, match="pass one"):
        RunConfig.from_dict(raw | {"resume": True, "overwrite": True})
    assert RunConfig.from_dict(raw | {"overwrite": True}).overwrite is True
