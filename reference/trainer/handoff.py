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
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from reference.tokenizer import Tokenizer

WEIGHTS_FILE = "model.safetensors"
LATEST_FILE = "LATEST"


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


def write_directory_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """Run `write(tmp)` on a fresh temporary directory beside `target`, fsync it, then rename it to
    `target` (replacing an existing one). On any failure the temporary directory is removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        write(tmp)
        _fsync_tree(tmp)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def latest_version(root: str | Path) -> int | None:
    """The newest complete version under `root`, or None when nothing was published yet."""
    path = Path(root) / LATEST_FILE
    return int(path.read_text(encoding="utf-8")) if path.is_file() else None


def _replace_dir(tmp: Path, target: Path) -> None:
    old = None
    if target.exists():
        old = target.with_name(f".old-{target.name}-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    os.replace(tmp, target)
    _fsync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
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
