"""Engine backends by name, and `EngineSpec`: what one engine process runs.

`BACKENDS` is the one place a backend is declared; the engine process, the runtime's config (`engine.backend`)
and the `reference engine` / `serve` command lines read the names and entries from here. An entry names the
function that builds the backend's engine from an `EngineSpec` (`package.module:function`, imported only in the
engine process, so that nothing else imports torch or vLLM), the backend's frozen config class (its options beyond
what every engine has, declared with `options.option`: validated on construction and offered as command-line
flags), the dtype its engine keeps weights in (what a weight hand-off is cast to), whether a training run may use
it, and what it needs to run here, with the one message a user sees when that is missing. An unknown name is a
ValueError that lists the valid ones, as in mini-swe-agent's registry of environments.

A backend is one module (its engine, its config class, `from_spec`; the module imports its heavy dependencies only
inside the engine, since the registry imports it for the config when first asked) and one entry below:
reference/engine/fake.py is the example. `EngineSpec` crosses to the engine process as one JSON document
(`to_json` / `from_json`); the process's token travels in its environment, never in the spec.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from core.errors import UserError, unknown_name
from reference.engine.base import MAX_SEED

GPU_EXTRA = "NVIDIA GPUs and the gpu extra (pip install -e '.[gpu]')"


@dataclass(frozen=True)
class Backend:
    """One engine backend, as the registry declares it."""

    engine: str  # "package.module:function": builds the engine from an EngineSpec, in the engine process
    config: str | type  # its frozen config class (its options), or that class as "package.module:Class", imported
    # when first asked for (so that a backend's module may import EngineSpec from here); options:NoOptions: none
    weights_dtype: str  # torch dtype (by name) its engine keeps weights in: what a weight hand-off carries
    trains: bool = True  # it loads new weights, so a training run may use it
    gpu: bool = False  # its engine runs on GPUs (the dry-run's plan places it there)
    needs_module: str | None = None  # a module it imports, looked for before an engine starts
    needs: str = ""  # what `needs_module` takes, in the words of the message when it is missing
    needs_checkpoint: bool = False  # it cannot run the built-in default model: `model` must be a directory

    @property
    def config_class(self) -> type:
        """The backend's config class (imported now when the entry names it by path)."""
        return self.config if isinstance(self.config, type) else _attribute(self.config)


# The built-in engine computes in fp32; a vLLM engine is started in bf16 (`vllm_engine.from_spec`), whatever the
# checkpoint's dtype. The fake engine is no model: a run cannot train on what it says.
BACKENDS: dict[str, Backend] = {
    "builtin": Backend("reference.engine.builtin:from_spec", "reference.engine.options:NoOptions", "float32"),
    "fake": Backend("reference.engine.fake:from_spec", "reference.engine.fake:FakeConfig", "float32", trains=False),
    "vllm": Backend(
        "reference.engine.vllm_engine:from_spec",
        "reference.engine.vllm_engine:VLLMConfig",
        "bfloat16",
        gpu=True,
        needs_module="vllm",
        needs=GPU_EXTRA,
        needs_checkpoint=True,
    ),
}


def backend(name: str) -> Backend:
    """The entry registered under `name`; an unknown name is a UserError (a ValueError) listing the valid ones."""
    entry = BACKENDS.get(name) if isinstance(name, str) else None
    if entry is None:
        raise unknown_name("engine backend", name, BACKENDS)
    return entry


def training_backends() -> tuple[str, ...]:
    """The backends a training run may use: those whose engines load new weights."""
    return tuple(name for name, entry in BACKENDS.items() if entry.trains)


def check_available(name: str, model: str | None = None) -> None:
    """UserError, in one line, when backend `name` cannot run here: a module it needs is not installed, or (with
    `model` given) it needs a checkpoint directory and `model` is the built-in "default"."""
    entry = backend(name)
    if entry.needs_checkpoint and model == "default":
        raise UserError(f"engine backend {name!r} needs a local checkpoint directory as its model (--model DIR)")
    if entry.needs_module is not None and importlib.util.find_spec(entry.needs_module) is None:
        others = ", ".join(n for n, e in BACKENDS.items() if e.needs_module is None and e.trains)
        raise UserError(f"engine backend {name!r} needs {entry.needs}; without them use backend {others}")


def engine_factory(name: str) -> Callable[[EngineSpec], Any]:
    """The function that builds backend `name`'s engine (imported now)."""
    return _attribute(backend(name).engine)


def _attribute(path: str) -> Any:
    """The object `package.module:name` names (its module imported now)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def options_of(name: str, given: Any) -> Any:
    """Backend `name`'s config from `given`: None (its defaults), a mapping of its fields, or an instance."""
    config = backend(name).config_class
    if given is None:
        return config()
    if isinstance(given, config):
        return given
    if not isinstance(given, Mapping):
        raise ValueError(f"options of engine backend {name!r} must be a {config.__name__} or a mapping, got {given!r}")
    allowed = [f.name for f in fields(config)]
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        choices = ", ".join(allowed) or "none"
        raise ValueError(f"unknown option {unknown[0]!r} of engine backend {name!r}; its options: {choices}")
    return config(**given)


@dataclass(frozen=True)
class OptionFlag:
    """A backend option as a command-line flag (`--token-delay-s` for `token_delay_s`)."""

    field: str  # the config field it sets
    kind: type  # int | float
    help: str
    ranges: dict[str, tuple[float, float | None]]  # backend -> the field's [low, high] in its config


def option_flags() -> dict[str, OptionFlag]:
    """Every backend option as a command-line flag, by flag. Backends whose configs have a field of the same name
    share its flag (and must give it the same type)."""
    flags: dict[str, OptionFlag] = {}
    for name, entry in BACKENDS.items():
        hints = typing.get_type_hints(entry.config_class)
        for f in fields(entry.config_class):
            flag, low_high = "--" + f.name.replace("_", "-"), f.metadata["range"]
            text = f"{f.metadata['help']} (default {f.default})"
            seen = flags.get(flag)
            if seen is None:
                flags[flag] = OptionFlag(f.name, hints[f.name], f"{name} backend: {text}", {name: low_high})
                continue
            assert seen.kind is hints[f.name], f"{flag}: backends give the field {f.name} different types"
            flags[flag] = OptionFlag(
                f.name, seen.kind, f"{seen.help}; {name} backend: {text}", {**seen.ranges, name: low_high}
            )
    return flags


SPEC_FIELDS = (
    "backend",
    "model",
    "seed",
    "max_batch",
    "heartbeat_s",
    "coalesce_s",
    "torch_threads",
    "logprobs_mode",
    "options",
)
LOGPROBS_MODES = ("processed", "raw")  # each token's log-prob: of the distribution it was drawn from (after
# temperature and top-p; vLLM's "processed_logprobs") | of the model at temperature 1 (vLLM's "raw_logprobs")


def logprobs_temperature(mode: str, sampling_temperature: float) -> float:
    """The temperature the engines' log-probs are at: the sampling one for processed, 1 for raw."""
    return sampling_temperature if mode == "processed" else 1.0


def check_logprobs_mode(mode: Any) -> str:
    """`mode` when it is one of LOGPROBS_MODES; ValueError naming it and the choices otherwise."""
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")
    return mode


@dataclass(frozen=True)
class EngineSpec:
    """What one engine process runs: the settings every engine has, and its backend's config in `options`."""

    backend: str = "builtin"  # a name in BACKENDS
    model: str = "default"  # "default" (the tiny Qwen3) or a local checkpoint directory
    seed: int = 0
    max_batch: int = 32  # requests decoded together
    heartbeat_s: float = 5.0  # a quiet generation stream gets a heartbeat line this often
    coalesce_s: float = 0.0  # > 0: wait this long after a token for more to send in the same line
    torch_threads: int = 0  # CPU threads for torch in the engine process (0: torch's default, every core): the
    # cores the resource grants its engine, set by whoever places it; backends that compute elsewhere ignore it
    logprobs_mode: str = "processed"  # LOGPROBS_MODES: what each token's log-prob is of (the trainer scores the same)
    options: Any = None  # the backend's config: an instance of its class, a mapping of its fields, None: defaults

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", options_of(self.backend, self.options))  # normalised once, here
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be 'default' or a checkpoint directory, got {self.model!r}")
        _check_int("seed", self.seed, 0, MAX_SEED)
        _check_int("max_batch", self.max_batch, 1)
        _check_int("torch_threads", self.torch_threads, 0)
        check_logprobs_mode(self.logprobs_mode)
        if not (_is_number(self.heartbeat_s) and self.heartbeat_s > 0):
            raise ValueError(f"heartbeat_s must be > 0 seconds, got {self.heartbeat_s!r}")
        if not (_is_number(self.coalesce_s) and 0 <= self.coalesce_s < math.inf):
            raise ValueError(f"coalesce_s must be >= 0 seconds, got {self.coalesce_s!r}")

    @property
    def weights_dtype(self) -> str:
        """The torch dtype (by name) this engine holds its weights in: what a weight hand-off should carry."""
        return backend(self.backend).weights_dtype

    def to_json(self) -> str:
        """The spec as one JSON document (`from_json` reads it back)."""
        common = {name: getattr(self, name) for name in SPEC_FIELDS[:-1]}
        return json.dumps(common | {"options": asdict(self.options)}, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        """The spec `to_json` wrote; ValueError names what is wrong with any other document."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"an engine spec must be a JSON object: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"an engine spec must be a JSON object, got {text[:80]!r}")
        unknown = sorted(set(data) - set(SPEC_FIELDS))
        if unknown:
            raise ValueError(f"unknown engine spec field {unknown[0]!r}; its fields: {', '.join(SPEC_FIELDS)}")
        return cls(**data)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in {low}..{high}"
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
