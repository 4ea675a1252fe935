"""Calibration profiles: what one device measured (benchmarks/gpu_calibration.py writes them), for the
simulator's calibrated cost model to read.

A profile is a YAML (or JSON) file: a `version`, the `device` it was measured on, and per model the
measured points: decode (a step of `batch` sequences at `context` tokens each: `step_s`), prefill
(`tokens` of one prompt: `seconds`), training (forward + backward + AdamW of one sequence of
`seq_len` tokens: `tokens_per_s`, and `mfu` where the device's peak is known) and log-probs (the
trainer's forward-only pass over one sequence: `tokens_per_s`, `mfu`). The device's own measured
peaks (a large matrix product, a device-to-device copy, host-to-device copies) and how decode ran
(`decode_mode`: eager, or replayed CUDA graphs) sit beside its name. `Profile` owns both
directions: `load_profile` validates every field, and a `UserError` names the key that is wrong, with
its path in the file; `Profile.to_dict` / `write_profile` produce what `load_profile` reads.
`costs.profile` names a shipped profile (configs/profiles/, `read_profile`) or a file; every point is
measured in `MEASURED_SETUP` (one GPU), which is where sim/calibration.py fits the roofline to it.

    version: 1
    device: {name: NVIDIA H100 80GB HBM3, spec: h100, dtype: bfloat16, torch_device: cuda:0, torch: 2.11.0}
    models:
      - model: qwen3-8b
        decode: [{batch: 8, context: 2048, step_s: 0.0141}]
        prefill: [{tokens: 2048, seconds: 0.105}]
        train: [{seq_len: 2048, tokens_per_s: 9100.0, mfu: 0.41}]
        logprob: [{seq_len: 2048, tokens_per_s: 31000.0, mfu: 0.47}]
        skipped: ["train seq_len=8192: out of memory"]
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path

import yaml

from core import specs
from core.errors import UserError, unknown_name

PROFILE_VERSION = 1  # the only version this simulator reads
PROFILE_DIR = Path(__file__).parent / "configs" / "profiles"  # shipped profiles, by name (`costs.profile`)
# What a profile's points are: the simulator's config overrides under which its roofline predicts them
# (benchmarks/gpu_calibration.py measures in this setup; sim/calibration.py fits in it). Decode and prefill
# on one GPU; training of one sequence on one GPU, no recompute, no log-prob pass, no fixed overhead, with
# weights, gradients and AdamW moments in bf16 (2 + 2 + 4 bytes a parameter).
MEASURED_SETUP = (
    "rollout.tensor_parallel=1",
    "rollout.expert_parallel=1",
    "train.recompute_logprobs=false",
    "train.reference_model=false",
    "train.activation_recompute=none",
    "train.grad_bytes_per_param=2",
    "train.optimizer_bytes_per_param=4",
    "train.mini_batches=1",
    "train.ppo_epochs=1",
    "train.tensor_parallel=1",
    "train.pipeline_parallel=1",
    "train.expert_parallel=1",
    "costs.train_step_overhead_s=0",
    "costs.profile=null",
)


@dataclass(frozen=True)
class DecodePoint:
    batch: int  # sequences decoded together
    context: int  # tokens of each sequence's KV cache before the step
    step_s: float  # seconds per decode step (one token for each sequence)


@dataclass(frozen=True)
class PrefillPoint:
    tokens: int  # one prompt's length
    seconds: float


@dataclass(frozen=True)
class TrainPoint:
    seq_len: int  # one sequence a step
    tokens_per_s: float
    mfu: float | None = None  # model FLOPs / (seconds x the device's peak); null where no peak is known


@dataclass(frozen=True)
class LogprobPoint:
    seq_len: int  # one sequence a forward pass (no gradient), log-probs of every token taken
    tokens_per_s: float
    mfu: float | None = None  # forward FLOPs / (seconds x the device's peak); null where no peak is known


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # what the measuring library called the device
    dtype: str  # of the weights, activations and optimizer state
    spec: str | None = None  # the shipped device spec (core/specs/devices.yaml) it corresponds to, if any
    torch_device: str | None = None
    torch: str | None = None  # library versions
    transformers: str | None = None
    decode_mode: str | None = None  # "eager" (a Python call a step) or "cuda-graphs" (one replay a step)
    matmul_tflops: float | None = None  # measured: a large square matrix product in `dtype`
    copy_gb_s: float | None = None  # measured: a device-to-device copy, bytes read + written a second
    host_to_device_gb_s: float | None = None  # measured: from pinned host memory
    device_to_host_gb_s: float | None = None  # measured: to pinned host memory


@dataclass(frozen=True)
class ModelProfile:
    model: str  # a shipped model name (core/specs/models.yaml), or "tiny"
    decode: tuple[DecodePoint, ...] = ()
    prefill: tuple[PrefillPoint, ...] = ()
    train: tuple[TrainPoint, ...] = ()
    logprob: tuple[LogprobPoint, ...] = ()
    skipped: tuple[str, ...] = ()  # points not measured, and why


@dataclass(frozen=True)
class Profile:
    version: int
    device: DeviceInfo
    models: tuple[ModelProfile, ...]
    created: str | None = None  # ISO 8601
    command: str | None = None  # the command line that measured it

    def model(self, name: str) -> ModelProfile:
        for entry in self.models:
            if entry.model == name:
                return entry
        raise unknown_name("model in the profile", name, [m.model for m in self.models])

    def to_dict(self) -> dict:
        """The mapping `load_profile` reads back (tuples as lists)."""
        return json.loads(json.dumps(asdict(self)))


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def profile_path(name: str) -> Path:
    """A shipped profile by name (sim/configs/profiles/NAME.yaml), or a profile file by path (relative to
    the current folder, as model and device files are)."""
    shipped = PROFILE_DIR / f"{name}.yaml"
    if "/" not in name and "\\" not in name and shipped.is_file():
        return shipped
    if Path(name).is_file():
        return Path(name)
    raise UserError(
        f"profile {name!r} is neither a shipped profile ({', '.join(shipped_profiles()) or 'none'}) nor a file"
    )


def read_profile(name: str) -> Profile:
    """`load_profile` of `profile_path(name)`, read once per process while the file is unchanged."""
    path = profile_path(name)
    stat = path.stat()
    return _read(str(path.resolve()), stat.st_mtime_ns, stat.st_size, name)


@lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int, size: int, name: str) -> Profile:
    del mtime_ns, size  # cache keys: a rewritten file is read again
    try:
        return load_profile(path)
    except UserError as exc:  # name the file as the config did
        raise UserError(str(exc).replace(repr(path), repr(name), 1)) from None


def entry_for(profile: Profile, model: specs.ModelSpec, name: str) -> ModelProfile | None:
    """The profile's measurements of `model` (config name `name`): by name, any case, or else of a shipped
    model with the same architecture (a config.json of qwen3-8b matches a profile's qwen3-8b)."""
    names = {name.lower(), model.name.lower()}
    for entry in profile.models:
        if entry.model.lower() in names:
            return entry
    return next((e for e in profile.models if specs.models().get(e.model.lower()) == model), None)


def write_profile(profile: Profile, path: str | Path) -> Path:
    """Write `profile` as YAML (JSON where the name ends in .json)."""
    path = Path(path)
    data = profile.to_dict()
    text = json.dumps(data, indent=1) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
    path.write_text(text)
    return path


# Per kind of point: its record and the fields that name a point (unique within a model); the others are measured.
POINT_KINDS = {
    "decode": (DecodePoint, ("batch", "context")),
    "prefill": (PrefillPoint, ("tokens",)),
    "train": (TrainPoint, ("seq_len",)),
    "logprob": (LogprobPoint, ("seq_len",)),
}


def measured_fields(kind: str) -> tuple[str, ...]:
    """The fields of a point of `kind` that were measured (the first: what a point takes, seconds or a rate)."""
    cls, keys = POINT_KINDS[kind]
    return tuple(f.name for f in fields(cls) if f.name not in keys)


def points_by_key(runs: list[ModelProfile], kind: str) -> dict[tuple, list]:
    """Every point of `kind` in `runs`, grouped by the fields that name it, in the order first measured."""
    keys = POINT_KINDS[kind][1]
    grouped: dict[tuple, list] = {}
    for run in runs:
        for point in getattr(run, kind):
            grouped.setdefault(tuple(getattr(point, k) for k in keys), []).append(point)
    return grouped


DEVICE_MEASURED = ("matmul_tflops", "copy_gb_s", "host_to_device_gb_s", "device_to_host_gb_s")


def median_profile(profiles: list[Profile], command: str | None = None) -> Profile:
    """One profile from several measurements of the same device and models (each in a process of its own): each
    point's median over the runs that measured it, kept where most runs did (else listed in `skipped` with how many
    did); the device's measured peaks likewise. A `UserError` when the runs are not of one device, dtype, decode
    mode and list of models. The median, not the mean: one run's point can be 1.5x another's where the host's
    launches bind (short prefills, eager passes), and a slow outlier should not move it."""
    if not profiles:
        raise UserError("no profiles to take the median of")
    first = profiles[0]
    for i, other in enumerate(profiles[1:], start=2):
        for key in ("name", "dtype", "decode_mode", "torch_device"):
            if getattr(other.device, key) != getattr(first.device, key):
                raise UserError(
                    f"profile {i} was measured with device {key} {getattr(other.device, key)!r}, profile 1 with "
                    f"{getattr(first.device, key)!r}: only runs of one setup have a median"
                )
        if [m.model for m in other.models] != [m.model for m in first.models]:
            raise UserError(
                f"profile {i} measured models {[m.model for m in other.models]}, profile 1 "
                f"{[m.model for m in first.models]}: only runs of one setup have a median"
            )
    device_values = {key: _median_or_none([getattr(p.device, key) for p in profiles]) for key in DEVICE_MEASURED}
    device = DeviceInfo(**{**asdict(first.device), **device_values})
    models = tuple(_median_model([p.models[i] for p in profiles]) for i in range(len(first.models)))
    return Profile(first.version, device, models, created=first.created, command=command or first.command)


def _median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _median_model(runs: list[ModelProfile]) -> ModelProfile:
    kinds = {}
    said = Counter(text for run in runs for text in set(run.skipped))
    skipped = {text if n == len(runs) else f"{text} ({n} of {len(runs)} runs)" for text, n in said.items()}
    for kind, (cls, keys) in POINT_KINDS.items():
        points = []
        for key, group in points_by_key(runs, kind).items():
            named = dict(zip(keys, key, strict=True))
            if 2 * len(group) <= len(runs):
                where = " ".join(f"{k}={v}" for k, v in named.items())
                skipped.add(f"{kind} {where}: measured in {len(group)} of {len(runs)} runs; not kept")
                continue
            medians = {m: _median_or_none([getattr(p, m) for p in group]) for m in measured_fields(kind)}
            points.append(cls(**named, **medians))
        kinds[kind] = tuple(points)
    return ModelProfile(runs[0].model, **kinds, skipped=tuple(sorted(skipped)))


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile; a `UserError` names the file and the key that is wrong."""
    where = f"profile {str(path)!r}"
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{where} does not exist")
    try:
        data = yaml.safe_load(p.read_text())  # JSON is YAML
    except yaml.YAMLError as exc:
        raise UserError(f"{where} is not valid YAML or JSON: {' '.join(str(exc).split())}") from None
    return profile_from_dict(data, where)


def profile_from_dict(data: object, where: str = "profile") -> Profile:
    top = _mapping(data, where, "", Profile)
    version = top.get("version")
    if version != PROFILE_VERSION:
        raise UserError(f"{where}: version must be {PROFILE_VERSION} (what this simulator reads), got {version!r}")
    models = _list(top.get("models"), where, "models", required=True)
    if not models:
        raise UserError(f"{where}: models must list at least one model")
    parsed = tuple(_model(entry, where, f"models[{i}]") for i, entry in enumerate(models))
    names = [m.model for m in parsed]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise UserError(f"{where}: models: model {duplicate!r} appears twice")
    return Profile(
        version=version,
        device=_record(DeviceInfo, top.get("device"), where, "device"),
        models=parsed,
        created=_optional_text(top.get("created"), where, "created"),
        command=_optional_text(top.get("command"), where, "command"),
    )


def _model(data: object, where: str, key: str) -> ModelProfile:
    entry = _mapping(data, where, key, ModelProfile)
    model = entry.get("model")
    if not isinstance(model, str) or not model:
        raise UserError(f"{where}: {key}.model must be a model name, got {model!r}")
    points = {
        name: _points(cls, entry.get(name), where, f"{key}.{name}", keys) for name, (cls, keys) in POINT_KINDS.items()
    }
    skipped = _list(entry.get("skipped"), where, f"{key}.skipped")
    for i, reason in enumerate(skipped):
        if not isinstance(reason, str):
            raise UserError(f"{where}: {key}.skipped[{i}] must be a string, got {reason!r}")
    return ModelProfile(model, **points, skipped=tuple(skipped))


def _points(cls: type, data: object, where: str, key: str, unique: tuple[str, ...]) -> tuple:
    points = tuple(_record(cls, item, where, f"{key}[{i}]") for i, item in enumerate(_list(data, where, key)))
    seen: set[tuple] = set()
    for i, point in enumerate(points):
        at = tuple(getattr(point, k) for k in unique)
        if at in seen:
            named = ", ".join(f"{k}={v}" for k, v in zip(unique, at, strict=True))
            raise UserError(f"{where}: {key}[{i}] repeats the point {named}")
        seen.add(at)
    return points


# Per field of a record: (kind, check). Counts are integers >= 1; times and rates finite and > 0.
_COUNT, _POSITIVE, _FRACTION, _TEXT, _OPTIONAL_TEXT = "count", "positive", "fraction", "text", "optional text"
_OPTIONAL_POSITIVE = "optional positive"
_KINDS = {
    DecodePoint: {"batch": _COUNT, "context": _COUNT, "step_s": _POSITIVE},
    PrefillPoint: {"tokens": _COUNT, "seconds": _POSITIVE},
    TrainPoint: {"seq_len": _COUNT, "tokens_per_s": _POSITIVE, "mfu": _FRACTION},
    LogprobPoint: {"seq_len": _COUNT, "tokens_per_s": _POSITIVE, "mfu": _FRACTION},
    DeviceInfo: {
        "name": _TEXT,
        "dtype": _TEXT,
        **dict.fromkeys(("spec", "torch_device", "torch", "transformers", "decode_mode"), _OPTIONAL_TEXT),
        **dict.fromkeys(
            ("matmul_tflops", "copy_gb_s", "host_to_device_gb_s", "device_to_host_gb_s"), _OPTIONAL_POSITIVE
        ),
    },
}
_MUSTS = {
    _COUNT: "an integer >= 1",
    _POSITIVE: "a finite number > 0",
    _FRACTION: "null or a number in (0, 1]",
    _TEXT: "a non-empty string",
    _OPTIONAL_TEXT: "null or a string",
    _OPTIONAL_POSITIVE: "null or a finite number > 0",
}


def _record(cls: type, data: object, where: str, key: str):
    values = _mapping(data, where, key, cls)
    kinds = _KINDS[cls]
    required = [f.name for f in fields(cls) if kinds[f.name] in (_COUNT, _POSITIVE, _TEXT)]
    missing = [name for name in required if name not in values]
    if missing:
        raise UserError(f"{where}: {key} lacks {missing[0]!r} (required: {', '.join(required)})")
    for name, value in values.items():
        if not _ok(kinds[name], value):
            raise UserError(f"{where}: {key}.{name} must be {_MUSTS[kinds[name]]}, got {value!r}")
    numbers = (_POSITIVE, _OPTIONAL_POSITIVE)
    return cls(**{name: float(v) if kinds[name] in numbers and v is not None else v for name, v in values.items()})


def _ok(kind: str, value: object) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind == _COUNT:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if kind == _POSITIVE:
        return number and math.isfinite(value) and value > 0
    if kind == _OPTIONAL_POSITIVE:
        return value is None or (number and math.isfinite(value) and value > 0)
    if kind == _FRACTION:
        return value is None or (number and 0 < value <= 1)
    if kind == _TEXT:
        return isinstance(value, str) and bool(value)
    return value is None or isinstance(value, str)


def _mapping(data: object, where: str, key: str, cls: type) -> dict:
    at = f"{key} " if key else ""
    if not isinstance(data, dict):
        raise UserError(f"{where}: {at}must be a mapping, got {type(data).__name__} {data!r:.60}")
    known = [f.name for f in fields(cls)]
    unknown = [k for k in data if k not in known]
    if unknown:
        name = f"{key}.{unknown[0]}" if key else unknown[0]
        raise UserError(f"{where}: {name} is not a known key; valid keys: {', '.join(known)}")
    return data


def _list(data: object, where: str, key: str, required: bool = False) -> list:
    if data is None and not required:
        return []
    if not isinstance(data, list):
        raise UserError(f"{where}: {key} must be a list, got {data!r:.60}")
    return data


def _optional_text(value: object, where: str, key: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise UserError(f"{where}: {key} must be null or a string, got {value!r}")
    return value
