"""Config loading: YAML files plus dotted `key.path=value` overrides into frozen dataclasses.

A field without a default is required (the defaults live in the shipped YAML files); a key whose field has
a default may be left out and takes it (a section declared with its defaults in code, as the policy's settings
are: `core/policies/settings.py`). Unknown keys, missing keys and values of the wrong type raise `UserError`
naming the dotted key.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from core.errors import UserError

_EXPONENT_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if p.is_dir():
        raise UserError(f"config file {str(p)!r} is a folder; give a YAML file")
    if not p.is_file():
        raise UserError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"config file {str(p)!r} cannot be read: {exc}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {str(p)!r} must hold a mapping at the top level")
    return exponent_numbers(data)


def exponent_numbers(value: Any) -> Any:
    """`value` with every string that is a number in exponent notation (`5e-4`) made a float, through mappings
    and lists: YAML 1.1 reads an exponent without a dot as a string, and sections that are plain mappings
    (`trainer`, `warm_start`, `task.options`) are not typed here to convert them later."""
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        return float(value)
    if isinstance(value, Mapping):
        return {k: exponent_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [exponent_numbers(v) for v in value]
    return value


def merge(base: Mapping, update: Mapping) -> dict:
    """Recursive dict merge: values in `update` win; nested mappings merge key by key."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_overrides(data: Mapping, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` strings; values are parsed as YAML scalars (`3`, `0.5`, `true`, `null`)."""
    out = dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r} must look like key.path=value")
        try:
            value = exponent_numbers(yaml.safe_load(raw)) if raw else ""
        except yaml.YAMLError:
            value = raw
        update: Any = value
        for part in reversed(key.split(".")):
            update = {part: update}
        out = merge(out, update)
    return out


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a mapping, checking keys and types against its fields."""
    if not isinstance(data, Mapping):
        raise UserError(f"config key {path or '<root>'!r} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [k for k in data if k not in names]
    if unknown:
        key = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise UserError(f"unknown config key {key!r}; valid keys here: {', '.join(names)}")
    defaulted = {f.name for f in dataclasses.fields(cls) if _has_default(f)}
    missing = [n for n in names if n not in data and n not in defaulted]
    if missing:
        key = f"{path}.{missing[0]}" if path else missing[0]
        raise UserError(f"missing config key {key!r}")
    kwargs = {n: _convert(hints[n], data[n], f"{path}.{n}" if path else n) for n in names if n in data}
    return cls(**kwargs)


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _convert(opt, value, path)
            except UserError as exc:
                errors.append(str(exc))
        raise UserError(errors[0])
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise UserError(f"config key {path!r} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise UserError(f"config key {path!r} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"config key {path!r} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
            value = float(value)  # 1e-4: YAML 1.1 reads an exponent without a dot as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"config key {path!r} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise UserError(f"config key {path!r} must be a string, got {value!r}")
        return value
    return value


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)
