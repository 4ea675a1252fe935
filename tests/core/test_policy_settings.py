"""The scheduling policy's settings: one class, its defaults in code, checked on construction, built by keyword."""

from __future__ import annotations

from dataclasses import fields

import pytest

from core import config as cfgio
from core.errors import UserError
from core.policies import PolicyConfig, PolicySettings


def test_a_mapping_that_leaves_a_setting_out_gets_its_default():
    assert cfgio.from_dict(PolicySettings, {}) == PolicySettings()
    assert cfgio.from_dict(PolicySettings, {"drain": True}) == PolicySettings(drain=True)


def test_an_unknown_setting_lists_the_valid_ones():
    with pytest.raises(UserError) as e:
        cfgio.from_dict(PolicySettings, {"max_stalenes": 2}, "policy")
    names = ", ".join(f.name for f in fields(PolicySettings))
    assert str(e.value) == f"unknown config key 'policy.max_stalenes'; valid keys here: {names}"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_staleness": -1}, "policy.max_staleness must be >= 0, got -1"),
        ({"max_staleness": 1.5}, "policy.max_staleness must be an integer, got 1.5"),
        ({"max_staleness": True}, "policy.max_staleness must be an integer, got True"),
        ({"window_batches": 0}, "policy.window_batches must be >= 1, got 0"),
        ({"fill_idle": "yes"}, "policy.fill_idle must be true or false, got 'yes'"),
        ({"drain": 1}, "policy.drain must be true or false, got 1"),
        ({"stale_samples": "keep"}, "unknown policy.stale_samples 'keep'; valid choices: drop, regenerate"),
    ],
)
def test_a_bad_setting_is_named_with_what_is_allowed(kwargs, message):
    with pytest.raises(UserError) as e:
        PolicySettings(**kwargs)
    assert str(e.value) == message


def test_settings_are_given_by_keyword_only():
    with pytest.raises(TypeError):
        PolicySettings(2)  # type: ignore[misc]
    with pytest.raises(TypeError):
        PolicyConfig(1, 2)  # type: ignore[misc]


def test_a_policy_config_carries_every_setting_and_the_runs_batch_and_length():
    settings = PolicySettings(max_staleness=2, window_batches=3, fill_idle=True, stale_samples="drop", drain=True)
    config = PolicyConfig.of(settings, batch_groups=4, num_steps=7)
    assert (config.batch_groups, config.num_steps) == (4, 7)
    assert {f.name: getattr(config, f.name) for f in fields(PolicySettings)} == {
        f.name: getattr(settings, f.name) for f in fields(PolicySettings)
    }


def test_a_policy_config_checks_the_runs_batch_and_length_too():
    with pytest.raises(UserError, match="policy.num_steps must be an integer, got 2.0"):
        PolicyConfig.of(PolicySettings(), batch_groups=1, num_steps=2.0)  # type: ignore[arg-type]
