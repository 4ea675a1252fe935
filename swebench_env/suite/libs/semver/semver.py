"""Semantic versions: parse, compare by precedence, bump, and match npm-style ranges."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["Version", "satisfies"]
__version__ = "3.0.1"

_VERSION = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$"
)


def _compare_identifiers(a: str, b: str) -> int:
    """Pre-release identifiers: numbers compare numerically and sort before words."""
    if a.isdigit() and b.isdigit():
        return (int(a) > int(b)) - (int(a) < int(b))
    if a.isdigit():
        return -1
    if b.isdigit():
        return 1
    return (a > b) - (a < b)


@functools.total_ordering
@dataclass(frozen=True)
class Version:
    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()
    build: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Version:
        found = _VERSION.match(text.strip())
        if found is None:
            raise ValueError(f"not a semantic version: {text!r}")
        major, minor, patch, pre, build = found.groups()
        return cls(int(major), int(minor), int(patch), tuple(pre.split(".")) if pre else (),
                   tuple(build.split(".")) if build else ())  # fmt: skip

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + ".".join(self.build)
        return text

    def compare(self, other: Version) -> int:
        """-1, 0 or 1 by semver precedence; build metadata is ignored."""
        core, other_core = (self.major, self.minor, self.patch), (other.major, other.minor, other.patch)
        if core != other_core:
            return -1 if core < other_core else 1
        if self.prerelease == other.prerelease:
            return 0
        if not self.prerelease:
            return 1
        if not other.prerelease:
            return -1
        for a, b in zip(self.prerelease, other.prerelease):
            result = _compare_identifiers(a, b)
            if result:
                return result
        return (len(self.prerelease) > len(other.prerelease)) - (len(self.prerelease) < len(other.prerelease))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self.compare(other) == 0

    def __lt__(self, other: Version) -> bool:
        return self.compare(other) < 0

    def __hash__(self) -> int:
        return hash((self.major, self.minor, self.patch, self.prerelease))

    def bump_major(self) -> Version:
        return Version(self.major + 1, 0, 0)

    def bump_minor(self) -> Version:
        return Version(self.major, self.minor + 1, 0)

    def bump_patch(self) -> Version:
        """The next patch release; a pre-release bumps to its own release."""
        if self.prerelease:
            return Version(self.major, self.minor, self.patch)
        return Version(self.major, self.minor, self.patch + 1)


def _upper_bound(op: str, v: Version) -> Version:
    """The first version a caret (^) or tilde (~) range excludes."""
    if op == "~":
        return Version(v.major, v.minor + 1, 0, ("0",))
    if v.major > 0:
        return Version(v.major + 1, 0, 0, ("0",))
    if v.minor > 0:
        return Version(0, v.minor + 1, 0, ("0",))
    return Version(0, 0, v.patch + 1, ("0",))


def _matches(version: Version, clause: str) -> bool:
    for op in (">=", "<=", ">", "<", "=", "^", "~"):
        if clause.startswith(op):
            bound = Version.parse(clause[len(op) :])
            break
    else:
        op, bound = "=", Version.parse(clause)
    if op in ("^", "~"):
        return bound <= version < _upper_bound(op, bound)
    return {
        ">=": version >= bound,
        "<=": version <= bound,
        ">": version > bound,
        "<": version < bound,
        "=": version == bound,
    }[op]


def satisfies(version: str | Version, spec: str) -> bool:
    """Whether `version` matches every space-separated clause of `spec` (">=1.2.0 <2.0.0", "^1.2.0", "~1.2.3")."""
    if isinstance(version, str):
        version = Version.parse(version)
    clauses = spec.split()
    if not clauses:
        raise ValueError("empty version range")
    return all(_matches(version, clause) for clause in clauses)
