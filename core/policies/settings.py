"""The scheduling policy's settings, declared once for every executor.

`PolicySettings` is the `policy` section a user writes: the simulator's config nests it as it is
(`sim.config.SimConfig.policy`) and the training run's config extends it with the policy's name and the run's
length (`reference.control.config.PolicySection`). Both are built from YAML by `core.config.from_dict`, which
takes the keys from the fields here, so a new setting is one field below (with its default, used where a file
leaves the key out), the policy that reads it, and its test: no edit in `sim/` or `reference/`.

`PolicyConfig` is what a policy is built with: those settings plus what the run fixes (the groups a step
trains, the steps in the run), built by keyword with `PolicyConfig.of`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from core.errors import UserError

STALE_SAMPLES = ("drop", "regenerate")  # PolicySettings.stale_samples


@dataclass(frozen=True, kw_only=True)
class PolicySettings:
    """What a user sets of the scheduling policy (the config's `policy` section).

    max_staleness: largest allowed policy-version lag of a trained token, in versions (training steps);
        `async`, `tag` and `streaming` (the strictly on-policy policies ignore it and always train at lag 0).
    window_batches: how many batches' worth of groups `tag` keeps in flight, finished or training
        (None: 1 + max_staleness, the most that can still be trained within the bound).
    fill_idle: `tag` starts extra groups beyond the window when a rollout resource runs dry. It turns idle
        time into generation, but under a strict staleness bound most of that work is later regenerated, so
        it is off by default (see docs/simulator.md).
    stale_samples: what `streaming` does with a finished group that fell out of the staleness bound:
        "regenerate" its stale samples (the rest of the group is kept) or "drop" the whole group and start a
        new one in its place.
    drain: submit no group beyond what the run's remaining steps consume, so the last steps run without work
        that no step will train (a complete training run: the shortest wall time). Off by default: a run then
        measures `num_steps` steps of a longer run, generating past its last step as a pipelined policy does in
        steady state (`BasePolicy.submit`).
    """

    max_staleness: int = 1
    window_batches: int | None = None
    fill_idle: bool = False
    stale_samples: str = "regenerate"
    drain: bool = False

    def __post_init__(self) -> None:
        _check_integer("max_staleness", self.max_staleness, 0)
        if self.window_batches is not None:
            _check_integer("window_batches", self.window_batches, 1)
        for name in ("fill_idle", "drain"):
            if not isinstance(getattr(self, name), bool):
                raise UserError(f"policy.{name} must be true or false, got {getattr(self, name)!r}")
        if self.stale_samples not in STALE_SAMPLES:
            choices = ", ".join(STALE_SAMPLES)
            raise UserError(f"unknown policy.stale_samples {self.stale_samples!r}; valid choices: {choices}")


@dataclass(frozen=True, kw_only=True)
class PolicyConfig(PolicySettings):
    """A policy's whole config: the settings, and what the run fixes.

    batch_groups: prompt groups consumed by one training step.
    num_steps: training steps in the run; the policy is done after the last one.
    """

    batch_groups: int
    num_steps: int

    def __post_init__(self) -> None:
        for name in ("batch_groups", "num_steps"):
            _check_integer(name, getattr(self, name), 1)
        super().__post_init__()

    @classmethod
    def of(cls, settings: PolicySettings, *, batch_groups: int, num_steps: int) -> PolicyConfig:
        """`settings` (a `PolicySettings`, or a config section that extends it) for a run of `num_steps` steps of
        `batch_groups` groups each."""
        values = {f.name: getattr(settings, f.name) for f in fields(PolicySettings)}
        return cls(batch_groups=batch_groups, num_steps=num_steps, **values)


def _check_integer(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"policy.{name} must be an integer, got {value!r}")
    if value < low:
        raise UserError(f"policy.{name} must be >= {low}, got {value}")
