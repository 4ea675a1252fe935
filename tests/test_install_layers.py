"""The Makefile's install layers: the simulator's targets need, install and import only the simulator's packages.

`make sim` on a fresh clone installs pyyaml, simpy, matplotlib and tqdm (the project's base
dependencies) and none of the runtime's extras. That holds only while the simulator and its
experiments import none of the runtime's packages, and while the simulator's targets depend on the
sim layer alone; each test below holds one half. `make -n` with `VENV` pointing at a folder that does
not exist prints what a fresh clone would run, without running it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PACKAGES = {"torch", "transformers", "tokenizers", "safetensors", "aiohttp", "openai", "ray", "vllm", "docker"}
SIM_TARGETS = ["setup-sim", "sim", "compare", "figures", "bench-sim"]
FULL_TARGETS = ["setup", "test", "test-fast", "lint", "serve", "train-math", "compare-train", "figures-runtime"]
SMALL = [  # the small config of tests/conftest.py, two steps
    "num_steps=2",
    "cluster.num_gpus=32",
    "workload.prompts_per_step=16",
    "model=qwen3-8b",
    "rollout.tensor_parallel=2",
]

# Runs `python -m sim` with the arguments given (timeline.png included), imports the simulator's
# experiments, then prints the exit status and every top-level module loaded, as JSON on the last line.
PROBE = """
import json, sys
from sim.cli import main
rc = main(sys.argv[1:])
import experiments.headline, experiments.sensitivity
print(json.dumps({"rc": rc, "modules": sorted({name.partition(".")[0] for name in sys.modules})}))
"""

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sim") / "run"
    args = ["--policy", "tag", "--out", str(out), "--quiet"] + [a for s in SMALL for a in ("--set", s)]
    done = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.splitlines()[-1]), "out": out}


def test_the_probe_simulation_succeeds(probe):
    assert probe["rc"] == 0
    assert (probe["out"] / "summary.json").is_file()


def test_the_simulator_and_its_experiments_import_no_runtime_package(probe):
    assert RUNTIME_PACKAGES & set(probe["modules"]) == set()


def test_the_simulator_imports_nothing_from_the_runtime(probe):
    assert "reference" not in probe["modules"]


def make_dry_run(tmp_path: Path, *args: str) -> str:
    """What `make args` would run on a fresh clone."""
    venv = tmp_path / "no-venv-yet"
    command = ["make", "--no-print-directory", "-n", *args, f"VENV={venv}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.replace(f"{venv}/bin/python -m ", "")


def installs(dry_run: str) -> list[str]:
    """The arguments of every `pip install` in a dry run, in order."""
    return [line.split("pip install --quiet ", 1)[1] for line in dry_run.splitlines() if "pip install" in line]


@needs_make
@pytest.mark.parametrize("target", SIM_TARGETS)
def test_a_simulator_target_installs_the_sim_layer_alone(tmp_path, target):
    assert installs(make_dry_run(tmp_path, target)) == ["--upgrade pip", "-e ."]


@needs_make
@pytest.mark.parametrize("target", FULL_TARGETS)
def test_a_runtime_target_installs_cpu_torch_then_the_runtime_and_dev_extras(tmp_path, target):
    assert installs(make_dry_run(tmp_path, target)) == [
        "--upgrade pip",
        '"torch==2.13.0" ${index:+--extra-index-url "$index"}',
        '-e ".[dev,reference,swe,tensorboard]"',
    ]


@needs_make
def test_the_torch_index_is_the_cpu_one_by_default(tmp_path):
    assert 'index="https://download.pytorch.org/whl/cpu"' in make_dry_run(tmp_path, "setup")


@needs_make
def test_serve_writes_a_fresh_store_by_default(tmp_path):
    assert re.search(r"--store results/serve-\d{8}-\d{6}\.sqlite$", make_dry_run(tmp_path, "serve"), re.M)


@needs_make
def test_serve_takes_the_store_it_is_given(tmp_path):
    assert "--store runs/a.sqlite\n" in make_dry_run(tmp_path, "serve", "STORE=runs/a.sqlite")


@needs_make
def test_help_is_what_a_bare_make_prints(tmp_path):
    assert make_dry_run(tmp_path) == make_dry_run(tmp_path, "help")


@needs_make
def test_help_lists_every_public_target():
    phony = re.search(r"^\.PHONY:((?:.*\\\n)*.*)", (ROOT / "Makefile").read_text(), re.M)[1].replace("\\\n", " ")
    help_text = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True)
    listed = {name for line in help_text.stdout.splitlines() for name in re.split(r"\s{2,}", line.strip())[0].split()}
    assert set(phony.split()) - listed == set()
