"""Versioned weight hand-off from the trainer to inference engines, through a local directory.

Layout under a hand-off root (what `InferenceEngine.update_weights(version, source)` reads, `source`
being a version directory; the built-in engine's `load_weights` and vLLM's loader both take it):

    root/v00000007/model.safetensors   every parameter except a tied lm_head.weight, the model's dtype
    root/v00000007/config.json         the Hugging Face model config
    root/v00000007/tokenizer.json      (+ tokenizer_config.json) when a tokenizer is given, so the
                                       directory is also a complete checkpoint for `load_checkpoint`
    root/LATEST                        the newest complete version number, as text

Atomicity: files are written and fsynced into a temporary directory beside the target, which is then
renamed into place, so a reader never sees a partial version; LATEST is replaced (write + rename)
after that. Re-saving an existing version (a resumed run repeats the steps after its checkpoint)
moves the old directory aside first, then removes it. Step k of the trainer produces version k + 1.

The same version can travel without a shared filesystem (`engine.weights_transport: object_store`): rank 0
turns the engine-facing tensors, cast to the engines' dtype, into a `WeightsPayload` (`trainer_payload`): plain
byte buffers that an object store (Ray's) holds once and moves to each engine's node. The worker that owns an
engine writes it (`write_payload`) as a version directory of the layout above, minus the tokenizer, under a
root on its own node, and its engine loads that. A payload's buffers are views of the tensors (of the trainer's
weights themselves where the dtype already matches): serialize it, as returning it from a Ray call does, before
the weights change again. The initial weights a run wrote itself travel the same way as a directory's files
(`read_files` / `write_files`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from reference.tokenizer import Tokenizer

WEIGHTS_FILE = "model.safetensors"
LATEST_FILE = "LATEST"
KEEP_LATEST_VERSIONS = 3  # an engine syncs to the newest or the one before: older ones are never read again
# torch dtype -> safetensors' name for it: the dtypes an engine may take its weights in
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class Handoff:
    """One published version: where it is, how long publishing took and how large it is."""

    version: int
    path: Path
    seconds: float
    bytes: int


def version_dir(root: str | Path, version: int) -> Path:
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    return Path(root) / f"v{version:08d}"


def engine_tensors(state: dict[str, torch.Tensor], tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """The tensors an engine loads: contiguous, on CPU, without a tied lm_head (it aliases the embedding)."""
    return {
        k: v.detach().to("cpu").contiguous()
        for k, v in state.items()
        if not (tie_word_embeddings and k == "lm_head.weight")
    }


def publish_weights(
    state: dict[str, torch.Tensor], config, root: str | Path, version: int, tokenizer: Tokenizer | None = None
) -> Handoff:
    """Write `state` (a model's full state dict) as version `version` under `root` (see module docstring)."""
    start = time.perf_counter()
    root = Path(root)
    target = version_dir(root, version)

    def write(tmp: Path) -> None:
        write_weights(state, config, tmp, metadata={"version": str(version)})
        if tokenizer is not None:
            tokenizer.save(tmp)

    write_directory_atomically(target, write)
    _write_atomic(root / LATEST_FILE, f"{version}\n")
    size = sum(f.stat().st_size for f in target.iterdir())
    return Handoff(version, target, time.perf_counter() - start, size)


def write_weights(state: dict[str, torch.Tensor], config, directory: Path, metadata: dict | None = None) -> None:
    """`model.safetensors` and `config.json` of the hand-off format into an existing directory."""
    tensors = engine_tensors(state, bool(getattr(config, "tie_word_embeddings", False)))
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt", **(metadata or {})})
    config.to_json_file(str(directory / "config.json"))


def write_directory_atomically(target: Path, write: Callable[[Path], None], durable: bool = True) -> None:
    """Run `write(tmp)` on a fresh temporary directory beside `target`, fsync it, then rename it to
    `target` (replacing an existing one). On any failure the temporary directory is removed. `durable`
    False: no fsync (a copy that need not outlive its process: the rename still hides a partial one)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        write(tmp)
        if durable:
            _fsync_tree(tmp)
        _replace_dir(tmp, target, durable)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def latest_version(root: str | Path) -> int | None:
    """The newest complete version under `root`, or None when nothing was published yet."""
    path = Path(root) / LATEST_FILE
    return int(path.read_text(encoding="utf-8")) if path.is_file() else None


def _replace_dir(tmp: Path, target: Path, durable: bool = True) -> None:
    old = None
    if target.exists():
        old = target.with_name(f".old-{target.name}-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    os.replace(tmp, target)
    if durable:
        _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_atomic(path: Path, text: str, durable: bool = True) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_tree(directory: Path) -> None:
    for f in directory.iterdir():
        with open(f, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the hand-off without a shared filesystem (see the module docstring) ----


@dataclass(frozen=True)
class WeightsPayload:
    """One version's engine-facing tensors as byte buffers (row-major, `dtype`), with the model config."""

    version: int
    dtype: str  # a torch dtype's name: float32, bfloat16, float16
    config_json: str  # the Hugging Face model config, as config.json holds it
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    buffers: tuple[np.ndarray, ...]  # uint8, one a tensor

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


def weights_dtype(name: str) -> torch.dtype:
    """The torch dtype an engine takes its weights in, by name (ValueError for one no engine takes)."""
    dtype = getattr(torch, name, None)
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"engine weights dtype must be one of float32, bfloat16, float16, got {name!r}")
    return dtype


def engine_payload(state: dict[str, torch.Tensor], config, version: int, dtype: str) -> WeightsPayload:
    """`state` (a model's full state dict) as the payload of version `version`, cast to `dtype`. No copy is
    made where a tensor is already contiguous, on CPU and of that dtype (see the module docstring)."""
    target = weights_dtype(dtype)
    tensors = engine_tensors(state, bool(getattr(config, "tie_word_embeddings", False)))
    names, shapes, buffers = [], [], []
    for name, tensor in tensors.items():
        t = tensor.to(target).contiguous()
        names.append(name)
        shapes.append(tuple(t.shape))
        buffers.append(t.reshape(-1).view(torch.uint8).numpy())  # the array keeps `t` alive
    return WeightsPayload(version, dtype, config.to_json_string(), tuple(names), tuple(shapes), tuple(buffers))


def trainer_payload(trainer, dtype: str) -> WeightsPayload | None:
    """The trainer's current weights as a payload of version `trainer.version` (rank 0; every rank must call it,
    as for `Trainer.publish`, since gathering a sharded model is collective, and gets None except rank 0)."""
    state = trainer.parallel.full_state_dict(trainer.model)
    payload = None
    if trainer.parallel.is_main:
        payload = engine_payload(state, trainer.model_config, trainer.version, dtype)
    trainer.parallel.barrier()
    return payload


def write_payload(payload: WeightsPayload, root: str | Path) -> Path:
    """Write `payload` as its version directory under `root` (model.safetensors in the payload's dtype and
    config.json, atomically as `publish_weights` does, LATEST too); returns the directory. Not fsynced: a
    node-local copy is its worker's alone and goes with it (a crash loses the worker too); the page cache is
    where its engine reads it from."""
    root = Path(root)
    target = version_dir(root, payload.version)

    def write(tmp: Path) -> None:
        _write_safetensors(tmp / WEIGHTS_FILE, payload, {"format": "pt", "version": str(payload.version)})
        (tmp / "config.json").write_text(payload.config_json, encoding="utf-8")

    write_directory_atomically(target, write, durable=False)
    _write_atomic(root / LATEST_FILE, f"{payload.version}\n", durable=False)
    return target


def _write_safetensors(path: Path, payload: WeightsPayload, metadata: dict[str, str]) -> None:
    """The safetensors format written from the buffers as they are (no tensor is built): an 8-byte little-endian
    header length, the JSON header (padded to 8 bytes), then every tensor's bytes in order."""
    code = SAFETENSORS_DTYPES[weights_dtype(payload.dtype)]
    itemsize = torch.empty((), dtype=weights_dtype(payload.dtype)).element_size()
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, shape, buffer in zip(payload.names, payload.shapes, payload.buffers, strict=True):
        if buffer.nbytes != itemsize * int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"payload tensor {name}: {buffer.nbytes} bytes do not hold a {payload.dtype} {shape}")
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + buffer.nbytes]}
        offset += buffer.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for buffer in payload.buffers:
            f.write(np.ascontiguousarray(buffer).data)


def read_files(directory: str | Path) -> dict[str, np.ndarray]:
    """Every file of `directory` (name -> its bytes as uint8), e.g. a checkpoint to ship; a checkpoint directory
    is flat, so a subdirectory is refused (ValueError) rather than left behind."""
    directory = Path(directory)
    entries = sorted(directory.iterdir())
    if nested := [p.name for p in entries if p.is_dir()]:
        raise ValueError(f"{directory} holds directories ({', '.join(nested)}): only a flat checkpoint can be shipped")
    if not entries:
        raise FileNotFoundError(f"no files in {directory}")
    return {p.name: np.fromfile(p, dtype=np.uint8) for p in entries}


def write_files(files: dict[str, np.ndarray], target: str | Path) -> Path:
    """`read_files`' result written back as the directory `target` (atomically, not fsynced: a worker's own
    copy, as for `write_payload`); returns it."""
    target = Path(target)

    def write(tmp: Path) -> None:
        for name, data in files.items():
            if not name or Path(name).name != name or name in (".", ".."):
                raise ValueError(f"file name {name!r} is not a plain name in the directory")
            with open(tmp / name, "wb") as f:
                f.write(np.ascontiguousarray(data).data)

    write_directory_atomically(target, write, durable=False)
    return target


def prune_local(root: str | Path, staged: Collection[int], keep: Collection[int] = ()) -> list[int]:
    """Remove the version directories of `staged` (the versions written under `root`) except the newest
    `KEEP_LATEST_VERSIONS` and those in `keep` (an engine's current version); returns the versions left."""
    newest = sorted(set(staged))[-KEEP_LATEST_VERSIONS:]
    left = sorted(set(newest) | (set(staged) & set(keep)))
    for version in set(staged) - set(left):
        shutil.rmtree(version_dir(root, version), ignore_errors=True)
    return left


def prune_versions(root: Path, newest: int, keep: Callable[[int], bool]) -> None:
    """Remove published versions older than the last `KEEP_LATEST_VERSIONS`, except those `keep` names (the
    initial weights, and the versions a checkpoint can resume from): a long run would fill the disk."""
    for version in range(max(0, newest - KEEP_LATEST_VERSIONS - 8), newest - KEEP_LATEST_VERSIONS + 1):
        path = version_dir(root, version)
        if not keep(version) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
