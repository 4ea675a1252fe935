"""A backend's options: the fields of its frozen config class, each with its range and its help, declared once.

A backend module declares its config with `option(default, low, high, help)` fields and calls `check_options` in
its `__post_init__`; the registry (backends.py) offers each field as a flag of the `reference engine` / `serve`
command lines from the same declaration.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import Any


def option(default: float, low: float, high: float | None = None, help: str = "") -> Any:
    """A backend config's field: its default, its range [low, high] (high None: no upper bound), and the help
    the command lines show for its flag."""
    return field(default=default, metadata={"range": (low, high), "help": help})


def check_options(config: Any) -> None:
    """Type and range of every field of a backend config (called by its `__post_init__`); ValueError names the
    field, its value and what is allowed. An int field takes integers only; a float field, any number."""
    hints = typing.get_type_hints(type(config))
    for f in fields(config):
        value, kind = getattr(config, f.name), hints[f.name]
        low, high = f.metadata["range"]
        where = f"{type(config).__name__}.{f.name}"
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or (kind is int and not isinstance(value, int))
        ):
            raise ValueError(f"{where} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
        if not (value >= low and (high is None or value <= high)):  # also refuses NaN
            allowed = f">= {low}" if high is None else f"in {low}..{high}"
            raise ValueError(f"{where} must be {allowed}, got {value}")


@dataclass(frozen=True)
class NoOptions:
    """The config of a backend that has no options of its own."""
