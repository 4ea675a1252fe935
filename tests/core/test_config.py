"""Tests for config loading: core.config's generic YAML-to-dataclass layer and sim.config on top."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import yaml

from core import config as cfgio
from core import specs
from core.errors import UserError
from sim.config import DEFAULT_CONFIG, SimConfig, config_dict, load_config


@dataclass(frozen=True)
class Inner:
    count: int
    rate: float
    name: str
    on: bool


@dataclass(frozen=True)
class Outer:
    inner: Inner
    limit: int | None
    extra: dict[str, int]


GOOD = {"inner": {"count": 3, "rate": 1, "name": "x", "on": False}, "limit": None, "extra": {"a": 1}}


def with_value(path: str, value) -> dict:
    data = {"inner": dict(GOOD["inner"]), "limit": GOOD["limit"], "extra": dict(GOOD["extra"])}
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node[part]
    node[leaf] = value
    return data


# ---- core.config ----


def test_from_dict_builds_nested_dataclasses_and_converts_ints_to_floats():
    out = cfgio.from_dict(Outer, GOOD)
    assert out == Outer(Inner(3, 1.0, "x", False), None, {"a": 1})
    assert type(out.inner.rate) is float
    assert cfgio.from_dict(Outer, with_value("limit", 7)).limit == 7


def test_unknown_key_names_its_dotted_path_and_the_valid_keys():
    with pytest.raises(UserError, match=r"unknown config key 'inner.cuont'; valid keys here: count, rate, name, on"):
        cfgio.from_dict(Outer, with_value("inner.cuont", 1))


def test_missing_key_names_its_dotted_path():
    data = with_value("inner.count", 1)
    del data["inner"]["rate"]
    with pytest.raises(UserError, match=r"missing config key 'inner.rate'"):
        cfgio.from_dict(Outer, data)
    with pytest.raises(UserError, match=r"missing config key 'limit'"):
        cfgio.from_dict(Outer, {k: v for k, v in GOOD.items() if k != "limit"})


@dataclass(frozen=True)
class WithDefault:
    needed: int
    optional: float = 0.5


def test_a_key_whose_field_has_a_default_may_be_left_out():
    assert cfgio.from_dict(WithDefault, {"needed": 1}) == WithDefault(1, 0.5)
    assert cfgio.from_dict(WithDefault, {"needed": 1, "optional": 2}).optional == 2.0
    with pytest.raises(UserError, match=r"missing config key 'needed'"):
        cfgio.from_dict(WithDefault, {"optional": 1.0})


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("inner.count", "abc", r"'inner.count' must be an integer, got 'abc'"),
        ("inner.count", 2.5, r"'inner.count' must be an integer, got 2.5"),
        ("inner.count", True, r"'inner.count' must be an integer, got True"),  # bool is an int in Python
        ("inner.rate", "fast", r"'inner.rate' must be a number, got 'fast'"),
        ("inner.rate", False, r"'inner.rate' must be a number"),
        ("inner.name", 5, r"'inner.name' must be a string, got 5"),
        ("inner.on", 1, r"'inner.on' must be true or false, got 1"),
        ("limit", "many", r"'limit' must be an integer, got 'many'"),
        ("extra", [1], r"'extra' must be a mapping"),
        ("inner", 3, r"'inner' must be a mapping, got 3"),
    ],
)
def test_type_errors_name_the_key_and_the_bad_value(path, value, message):
    with pytest.raises(UserError, match=message):
        cfgio.from_dict(Outer, with_value(path, value))


def test_overrides_parse_yaml_scalars_and_create_nested_keys():
    data = {"a": {"b": 1, "keep": "me"}, "flag": False}
    out = cfgio.apply_overrides(data, ["a.b=3", "a.c=0.5", "flag=true", "n=null", "s=abc", "empty=", "x.y.z=[1, 2]"])
    assert out == {
        "a": {"b": 3, "keep": "me", "c": 0.5},
        "flag": True,
        "n": None,
        "s": "abc",
        "empty": "",
        "x": {"y": {"z": [1, 2]}},
    }
    assert data == {"a": {"b": 1, "keep": "me"}, "flag": False}  # the input is not mutated
    assert cfgio.apply_overrides({}, ["k=a=b"]) == {"k": "a=b"}  # only the first '=' separates
    assert cfgio.apply_overrides({}, ["k=[unclosed"]) == {"k": "[unclosed"}  # not YAML: kept as text


def test_exponent_numbers_are_numbers_in_untyped_sections_too(tmp_path):
    """YAML 1.1 reads 5e-4 as a string; a plain-mapping section (trainer, warm_start) gets a float all the same,
    from an override, an inline mapping or a file."""
    out = cfgio.apply_overrides({}, ["trainer.lr=5e-4", "warm_start={lr: 3E-3, steps: 10}", "name=e5x"])
    assert out == {"trainer": {"lr": 5e-4}, "warm_start": {"lr": 3e-3, "steps": 10}, "name": "e5x"}
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  lr: 1e-4\n  betas: [9e-1, 0.95]\nnote: '2e3 steps'\n")
    assert cfgio.load_yaml(path) == {"trainer": {"lr": 1e-4, "betas": [0.9, 0.95]}, "note": "2e3 steps"}


@pytest.mark.parametrize("item", ["num_steps", "=3", ""])
def test_malformed_override(item):
    with pytest.raises(UserError, match="must look like key.path=value"):
        cfgio.apply_overrides({}, [item])


def test_merge_is_recursive_and_does_not_mutate():
    base = {"a": {"b": 1, "c": 2}, "d": 3}
    assert cfgio.merge(base, {"a": {"c": 20}, "e": 5}) == {"a": {"b": 1, "c": 20}, "d": 3, "e": 5}
    assert cfgio.merge(base, {"a": 7}) == {"a": 7, "d": 3}  # a scalar replaces a mapping
    assert base == {"a": {"b": 1, "c": 2}, "d": 3}


def test_load_yaml_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        cfgio.load_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(UserError, match="is not valid YAML"):
        cfgio.load_yaml(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="must hold a mapping at the top level"):
        cfgio.load_yaml(scalar)


# ---- sim.config ----


def test_default_config_is_the_documented_paper_setup():
    cfg = load_config()
    assert (cfg.model, cfg.cluster.device, cfg.cluster.num_gpus) == ("qwen3-32b", "h800", 64)
    assert cfg.num_resources == 16 and cfg.workload.kind == "math" and cfg.policy.max_staleness == 1
    assert load_config(DEFAULT_CONFIG) == cfg


def test_user_file_merges_over_defaults_then_overrides_win(tmp_path):
    user = tmp_path / "user.yaml"
    user.write_text("num_steps: 7\ncluster:\n  num_gpus: 32\nworkload:\n  response_tokens: {median: 900}\n")
    cfg = load_config(user)
    assert cfg.num_steps == 7 and cfg.cluster.num_gpus == 32
    assert cfg.cluster.device == "h800"  # sibling keys come from the defaults
    assert cfg.workload.response_tokens.median == 900.0 and cfg.workload.response_tokens.max == 16384.0
    cfg = load_config(user, ["num_steps=3", "cluster.device=h20"])
    assert (cfg.num_steps, cfg.cluster.num_gpus, cfg.cluster.device) == (3, 32, "h20")


def test_user_file_with_a_typo_is_rejected(tmp_path):
    user = tmp_path / "user.yaml"
    user.write_text("rollout:\n  tensor_paralel: 2\n")
    with pytest.raises(UserError, match=r"unknown config key 'rollout.tensor_paralel'"):
        load_config(user)


def test_sim_config_missing_key():
    data = config_dict(load_config())
    del data["costs"]["train_mfu"]
    with pytest.raises(UserError, match=r"missing config key 'costs.train_mfu'"):
        cfgio.from_dict(SimConfig, data)


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(overrides=["workload.kind=swe", "policy.window_batches=3", "seed=9"])
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(config_dict(cfg), sort_keys=False))
    assert load_config(saved) == cfg


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.nope=1"], r"unknown config key 'cluster.nope'; valid keys here: device, num_gpus"),
        (["num_steps=abc"], r"config key 'num_steps' must be an integer, got 'abc'"),
        (["rollout.gpu_memory_utilization=high"], r"'rollout.gpu_memory_utilization' must be a number"),
        (["train.reference_model=maybe"], r"'train.reference_model' must be true or false"),
        (["policy.window_batches=two"], r"'policy.window_batches' must be an integer"),
        (["model=llama-70b"], r"^model: unknown model 'llama-70b'; valid choices: llama-3.1-405b, .*qwen3-8b; or a"),
        (["cluster.device=tpu"], r"^cluster.device: unknown device 'tpu'; valid choices: a100, b200, .*, l40s; or a"),
        (["workload.kind=chat"], r"unknown workload 'chat'; valid choices: math, swe"),
        (["num_steps=0"], r"num_steps must be >= 1, got 0"),
        (["seed=-1"], r"seed must be >= 0, got -1"),
        (["cluster.num_gpus=30"], r"cluster.num_gpus=30 is not a multiple of rollout.tensor_parallel=4"),
        (["rollout.tensor_parallel=3", "cluster.num_gpus=48"], r"tensor_parallel=3 must divide the 8 GPUs"),
        (["rollout.tensor_parallel=16"], r"tensor_parallel=16 must divide the 8 GPUs"),
        (["costs.hbm_efficiency=1.5"], r"costs.hbm_efficiency must be a fraction in \(0, 1\], got 1.5"),
        (["costs.decode_mfu=0"], r"costs.decode_mfu must be a fraction in \(0, 1\], got 0"),
        (["costs.kv_hbm_efficiency=0"], r"costs.kv_hbm_efficiency must be a fraction in \(0, 1\], got 0"),
        (["workload.prefix_cache_hit=-0.1"], r"workload.prefix_cache_hit must be a fraction"),
        (["workload.turns.min=50"], r"workload.turns needs median > 0, sigma >= 0 and 0 <= min <= median <= max"),
        (["workload.response_tokens.sigma=-1"], r"workload.response_tokens needs"),
        (["workload.max_context_tokens=1"], r"workload.max_context_tokens must be >= 2, got 1"),
    ],
)
def test_sim_config_rejects_bad_values_by_name(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(overrides=overrides)


def test_device_and_model_names_are_case_insensitive():
    cfg = load_config(overrides=["model=Qwen3-8B", "cluster.device=H20"])
    assert specs.model(cfg.model).name == "qwen3-8b" and specs.device(cfg.cluster.device).name == "h20"


@pytest.mark.parametrize(("text", "expected"), [("1e-4", 1e-4), ("2E3", 2000.0), ("-1.5e+2", -150.0), (".5e1", 5.0)])
def test_a_number_with_an_exponent_is_a_number(text, expected):
    """YAML 1.1 reads 1e-4 (an exponent without a dot) as a string; a float field takes it as the number."""
    built = cfgio.from_dict(Outer, cfgio.apply_overrides(GOOD, [f"inner.rate={text}"]))
    assert built.inner.rate == expected
    for bad in ("1e", "e5", "1e-4x", "nan", "inf"):
        with pytest.raises(UserError, match="must be a number"):
            cfgio.from_dict(Outer, with_value("inner.rate", bad))
    with pytest.raises(UserError, match="must be an integer"):
        cfgio.from_dict(Outer, with_value("inner.count", "1e3"))
