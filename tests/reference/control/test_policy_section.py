"""Both executors' configs nest the one policy settings class (core/policies/settings.py): the same keys, the same
defaults, the same checks and the same policy config from the same settings."""

from __future__ import annotations

from dataclasses import asdict, fields

import pytest

from core.errors import UserError
from core.policies import PolicyConfig, PolicySettings
from reference.control.config import load_train_config, policy_config
from sim.config import load_config

SETTINGS = [f.name for f in fields(PolicySettings)]
CHANGED = [
    "policy.max_staleness=2",
    "policy.window_batches=3",
    "policy.fill_idle=true",
    "policy.stale_samples=drop",
    "policy.drain=true",
]


def _settings(section) -> dict:
    return {name: getattr(section, name) for name in SETTINGS}


def test_the_simulator_nests_the_settings_class_itself():
    assert type(load_config().policy) is PolicySettings


def test_the_training_run_extends_it_with_the_policy_name_and_the_run_length():
    policy = load_train_config().policy
    assert isinstance(policy, PolicySettings)
    assert [f.name for f in fields(policy)] == [*SETTINGS, "name", "num_steps"]


def test_the_shipped_files_state_the_defaults_the_class_declares():
    assert _settings(load_config().policy) == asdict(PolicySettings())
    assert _settings(load_train_config().policy) == asdict(PolicySettings())


def test_the_same_settings_give_both_executors_the_same_policy_config():
    sim = load_config(overrides=CHANGED)
    train = load_train_config(None, [*CHANGED, "policy.num_steps=4"])
    assert _settings(sim.policy) == _settings(train.policy) != asdict(PolicySettings())
    from_sim = PolicyConfig.of(sim.policy, batch_groups=train.rollout.prompts_per_step, num_steps=4)
    assert from_sim == policy_config(train)


@pytest.mark.parametrize(
    ("load", "extra"),
    [(lambda o: load_config(overrides=o), ""), (lambda o: load_train_config(None, o), ", name, num_steps")],
    ids=["sim", "train"],
)
def test_an_unknown_policy_key_lists_the_valid_ones(load, extra):
    with pytest.raises(UserError) as e:
        load(["policy.stalenes=2"])
    assert str(e.value) == f"unknown config key 'policy.stalenes'; valid keys here: {', '.join(SETTINGS)}{extra}"


@pytest.mark.parametrize("load", [lambda o: load_config(overrides=o), lambda o: load_train_config(None, o)])
def test_a_bad_setting_fails_the_same_in_both(load):
    with pytest.raises(UserError) as e:
        load(["policy.stale_samples=keep"])
    assert str(e.value) == "unknown policy.stale_samples 'keep'; valid choices: drop, regenerate"
