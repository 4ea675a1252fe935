"""The scheduling policies, chosen by name (the same names in the CLI, configs and figures)."""

from __future__ import annotations

from collections.abc import Sequence

from core.errors import unknown_name
from core.policies.async_ import AsyncPolicy
from core.policies.base import BasePolicy, Policy
from core.policies.colocated import ColocatedPolicy
from core.policies.disaggregated import DisaggregatedPolicy
from core.policies.settings import PolicyConfig, PolicySettings
from core.policies.streaming import StreamingPolicy
from core.policies.tag import TagPolicy
from core.tags import Resource

POLICIES: dict[str, type[BasePolicy]] = {
    "colocated": ColocatedPolicy,
    "disaggregated": DisaggregatedPolicy,
    "async": AsyncPolicy,
    "tag": TagPolicy,
    "streaming": StreamingPolicy,
}


def policy_class(name: str) -> type[BasePolicy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise unknown_name("policy", name, POLICIES) from None


def make_policy(name: str, config: PolicyConfig, num_resources: int, train_fraction: float, devices: int) -> BasePolicy:
    """Lay out the resources the way policy `name` wants them, and build the policy over them."""
    cls = policy_class(name)
    resources: Sequence[Resource] = cls.layout(num_resources, train_fraction, devices)
    return cls(resources, config)


__all__ = ["POLICIES", "Policy", "PolicyConfig", "PolicySettings", "BasePolicy", "make_policy", "policy_class"]
