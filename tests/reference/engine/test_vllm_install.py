"""The GPU install layer: `make setup-gpu` / `make test-gpu` install vLLM with the torch and transformers it
pins, and the `gpu` extra holds vLLM to the release the backend was checked against (vLLM 0.33: torch
2.14.0, transformers < 5.21). `make -n` with `VENV` pointing at a folder that does not exist prints what
a fresh clone would run, without running it."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def gpu_extra() -> dict[str, str]:
    """The `gpu` extra as {package: version specifier}."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return dict(re.fullmatch(r"([A-Za-z0-9_.-]+)(.*)", spec).groups() for spec in extras["gpu"])


def makefile_default(name: str) -> str:
    return re.search(rf"^{name} \?= (.*)$", (ROOT / "Makefile").read_text(), re.M)[1].strip()


def pip_installs(tmp_path: Path, target: str) -> list[str]:
    venv = tmp_path / "no-venv-yet"
    command = ["make", "--no-print-directory", "-n", target, f"VENV={venv}"]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    return [line.split("pip install --quiet ", 1)[1].strip() for line in out.splitlines() if "pip install" in line]


def test_the_gpu_extra_pins_vllm_033_and_what_it_needs():
    extra = gpu_extra()
    assert extra["vllm"] == ">=0.33.0,<0.34"
    assert extra["torch"] == f"=={makefile_default('GPU_TORCH_VERSION')}" == "==2.14.0"
    assert extra["transformers"] == ">=5.20,<5.21"  # vLLM 0.33: < 5.21; the runtime: >= 5.20


@needs_make
@pytest.mark.parametrize("target", ["setup-gpu", "test-gpu"])
def test_the_gpu_targets_install_the_pinned_cuda_torch_then_every_extra(tmp_path, target):
    assert pip_installs(tmp_path, target) == [
        "--upgrade pip",
        '"torch==2.14.0"',  # from pip's own indexes: the CUDA build, never the CPU index of `make setup`
        '-e ".[dev,reference,swe,tensorboard,gpu]"',
    ]


@needs_make
def test_another_cuda_build_comes_from_the_index_given(tmp_path):
    venv = tmp_path / "no-venv-yet"
    index = "GPU_TORCH_INDEX=https://example.invalid/whl/cu126"
    command = ["make", "--no-print-directory", "-n", "setup-gpu", f"VENV={venv}", index]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    assert '"torch==2.14.0" --extra-index-url "https://example.invalid/whl/cu126"' in out
