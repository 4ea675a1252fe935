"""A task's environment in Docker: install recipes built offline into cached task images, and `check` and
`derive-tests` running the tests in the task's own sandbox.

The task is written here: a one-file library whose tests import `tinyhelper`, a package that is not in the
base image. Its wheel is built here with `pip wheel` from a folder the test writes, so nothing needs a
network, except the one test of the `pip download` path (skipped when no package index answers).
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from swebench_env import cli
from swebench_env.environments import CACHE_ENV, WHEELHOUSE_ENV, RecipeError
from swebench_env.git import deterministic_env, git
from swebench_env.images import TASK_REPOSITORY, task_image
from swebench_env.sandbox import Sandbox, SandboxConfig
from swebench_env.tasks import load_tasks

pytestmark = pytest.mark.docker
BUILDING = "building task image"
CALC = "import tinyhelper\n\n\ndef double(x):\n    return tinyhelper.times(x, {n})\n"
TESTS = "import tinyhelper\n\nfrom calc import double\n\n\ndef test_helper():\n    assert tinyhelper.VERSION == '1.0'\n"
NEW_TEST = "\n\ndef test_double():\n    assert double(2) == 4\n"
RECIPE = {"pip": ["tinyhelper==1.0"]}


@pytest.fixture(scope="module", autouse=True)
def scratch_cache(tmp_path_factory, daemon):
    """Fetched wheels and build locks in a fresh folder; the task images these tests built removed afterwards
    (only those: others may be in use by another run)."""
    before = task_images(daemon)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("cache")))
        patch.delenv(WHEELHOUSE_ENV, raising=False)
        yield
    for tag in task_images(daemon) - before:
        daemon.images.remove(tag, force=True)


def task_images(client) -> set[str]:
    return {tag for image in client.images.list(name=TASK_REPOSITORY) for tag in image.tags}


@pytest.fixture(autouse=True)
def no_wheelhouse_from_a_previous_command(monkeypatch):
    monkeypatch.delenv(WHEELHOUSE_ENV, raising=False)  # `--wheelhouse` sets it for the process; undone here


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """A folder holding one wheel, built here (`pip wheel`, no index) from a package written here."""
    root = tmp_path_factory.mktemp("tinyhelper")
    package = root / "package"
    package.mkdir()
    (package / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "tinyhelper"\nversion = "1.0"\n\n[tool.setuptools]\npy-modules = ["tinyhelper"]\n'
    )
    (package / "tinyhelper.py").write_text('VERSION = "1.0"\n\n\ndef times(x, n):\n    return x * n\n')
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q"]
    subprocess.run([*argv, "-w", str(root / "wheels"), str(package)], check=True, timeout=300)
    return root / "wheels"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A folder with the task's repository and task files: with.jsonl (the recipe), without.jsonl (none),
    unlisted.jsonl (the recipe, no FAIL_TO_PASS or PASS_TO_PASS)."""
    root = tmp_path_factory.mktemp("task")
    repo, env = root / "repo", deterministic_env("2024-01-01T00:00:00+00:00")
    (repo / "tests").mkdir(parents=True)
    (repo / "calc.py").write_text(CALC.format(n=3))
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    git("init", "-q", "-b", "main", cwd=repo, env=env)
    git("add", "-A", cwd=repo, env=env)
    git("commit", "-q", "-m", "calc", cwd=repo, env=env)
    (repo / "calc.py").write_text(CALC.format(n=2))
    patch = git("diff", cwd=repo, env=env)
    git("checkout", "-q", "--", ".", cwd=repo, env=env)
    (repo / "tests" / "test_calc.py").write_text(TESTS + NEW_TEST)
    test_patch = git("diff", cwd=repo, env=env)
    git("checkout", "-q", "--", ".", cwd=repo, env=env)
    record = {"instance_id": "tiny-1", "repo": "me/calc", "base_commit": git("rev-parse", "HEAD", cwd=repo).strip(),
              "problem_statement": "double(2) is 6", "patch": patch, "test_patch": test_patch,
              "FAIL_TO_PASS": ["tests/test_calc.py::test_double"], "PASS_TO_PASS": ["tests/test_calc.py::test_helper"],
              "repo_path": "repo", "install": RECIPE}  # fmt: skip
    write(root / "with.jsonl", record)
    write(root / "without.jsonl", {k: v for k, v in record.items() if k != "install"})
    write(root / "unlisted.jsonl", {k: v for k, v in record.items() if k not in ("FAIL_TO_PASS", "PASS_TO_PASS")})
    return root


def write(path: Path, record: dict) -> Path:
    path.write_text(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def task(files):
    return load_tasks(files / "with.jsonl")[0]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def builds(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(BUILDING)]


def test_check_passes_with_the_recipe(capsys, files, wheelhouse):
    code, out, err = run(capsys, "check", files / "with.jsonl", "--wheelhouse", wheelhouse, "--jobs", "1")
    assert (code, err) == (0, "")
    assert out.endswith(": 1 ok, 0 bad\n")


def test_check_reports_the_task_broken_without_the_recipe(capsys, files):
    code, out, err = run(capsys, "check", files / "without.jsonl", "--jobs", "1")
    assert code == 1
    assert out.endswith(": 0 ok, 1 bad\n")
    assert "tiny-1: the gold patch does not resolve the task: its tests cannot import 'tinyhelper' " in err
    assert "give the task an 'install' recipe or an 'image' that provides it" in err


def test_the_task_image_is_built_once_and_reused(daemon, task, wheelhouse, caplog):
    caplog.set_level(logging.WARNING, logger="swebench_env.images")
    name = task_image(task, client=daemon, wheelhouse=wheelhouse)
    assert name.startswith(f"{TASK_REPOSITORY}:")  # removed next: never a shared image
    daemon.images.remove(name, force=True)
    caplog.clear()
    assert task_image(task, client=daemon, wheelhouse=wheelhouse) == name
    built = daemon.images.get(name).id
    assert builds(caplog) == [f"{BUILDING} {name}: {RECIPE | {'commands': []}}"]
    assert task_image(task, client=daemon, wheelhouse=wheelhouse) == name
    assert daemon.images.get(name).id == built
    assert len(builds(caplog)) == 1


def test_the_task_image_has_the_package_and_no_wheels(daemon, task, wheelhouse):
    image = task_image(task, client=daemon, wheelhouse=wheelhouse)
    with Sandbox(SandboxConfig(image=image, memory_mb=256)) as sb:
        result = sb.exec("python -c 'import tinyhelper; print(tinyhelper.VERSION)' && ls /tmp", timeout_s=60)
    assert (result.exit_code, result.output) == (0, "1.0\n")


def test_concurrent_builders_of_one_recipe_build_it_once(daemon, task, wheelhouse, caplog):
    caplog.set_level(logging.WARNING, logger="swebench_env.images")
    fresh = replace(task, extra={"install": {**RECIPE, "commands": [f"echo {uuid.uuid4().hex} > /marker"]}})
    names: list[str] = []
    threads = [threading.Thread(target=lambda: names.append(task_image(fresh, client=daemon, wheelhouse=wheelhouse)))
               for _ in range(3)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert len(names) == 3
    assert len(set(names)) == 1
    assert len(builds(caplog)) == 1


def test_a_requirement_missing_from_the_wheelhouse_names_itself(daemon, task, wheelhouse):
    missing = replace(task, extra={"install": {"pip": ["tinyhelper==1.0", "absent-package==2.0"]}})
    with pytest.raises(RecipeError) as error:
        task_image(missing, client=daemon, wheelhouse=wheelhouse)
    message = str(error.value)
    assert message.startswith("instance 'tiny-1': requirement 'absent-package==2.0' cannot be installed offline: ")
    assert "\n" not in message


def test_a_failing_install_command_names_itself(daemon, task, wheelhouse):
    failing = replace(task, extra={"install": {**RECIPE, "commands": ["true", "echo broken >&2; exit 3"]}})
    with pytest.raises(RecipeError, match=r"^instance 'tiny-1': field 'install.commands' item 1 \('echo broken"):
        task_image(failing, client=daemon, wheelhouse=wheelhouse)


def test_check_says_in_one_line_per_task_why_its_image_cannot_be_built(capsys, files, wheelhouse):
    record = json.loads((files / "with.jsonl").read_text()) | {"install": {"pip": ["absent-package==2.0"]}}
    code, _, err = run(capsys, "check", write(files / "absent.jsonl", record), "--wheelhouse", wheelhouse)
    assert code == 1
    assert err.startswith("tiny-1: its tests cannot run: instance 'tiny-1': requirement 'absent-package==2.0' ")
    assert err.count("\n") == 1


def test_a_bad_recipe_or_wheelhouse_is_a_one_line_user_error(capsys, files):
    record = json.loads((files / "with.jsonl").read_text()) | {"install": {"pip": ["-e ."]}}
    code, _, err = run(capsys, "check", write(files / "bad.jsonl", record))
    assert (code, err.count("\n")) == (2, 1)
    assert err.startswith(f"error: {files / 'bad.jsonl'} line 1: instance 'tiny-1': field 'install.pip' item 0: ")
    code, _, err = run(capsys, "check", files / "with.jsonl", "--wheelhouse", files / "nowhere")
    assert (code, err) == (2, f"error: wheelhouse {files / 'nowhere'} is not a folder (from --wheelhouse or "
                              f"${WHEELHOUSE_ENV})\n")  # fmt: skip


def test_derive_tests_writes_the_lists_in_the_tasks_sandbox(capsys, files, wheelhouse, tmp_path):
    out = tmp_path / "derived.jsonl"
    code, stdout, _ = run(capsys, "derive-tests", files / "unlisted.jsonl", "--wheelhouse", wheelhouse, "--out", out)
    assert code == 0
    assert stdout.startswith("tiny-1: 1 FAIL_TO_PASS, 1 PASS_TO_PASS, differ from the file\n")
    derived = json.loads(out.read_text())
    assert (derived["FAIL_TO_PASS"], derived["PASS_TO_PASS"]) == (["tests/test_calc.py::test_double"],
                                                                   ["tests/test_calc.py::test_helper"])  # fmt: skip
    original = json.loads((files / "unlisted.jsonl").read_text())
    assert {k: v for k, v in derived.items() if k not in ("FAIL_TO_PASS", "PASS_TO_PASS", "repo_path")} == {
        k: v for k, v in original.items() if k != "repo_path"
    }
    assert (out.parent / derived["repo_path"]).resolve() == (files / "repo").resolve()


def _index_answers() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _index_answers(), reason="no package index answers (pypi.org:443): pip download cannot run")
def test_without_a_wheelhouse_the_wheels_are_downloaded_once_for_the_base_images_python(daemon, task, caplog):
    caplog.set_level(logging.WARNING, logger="swebench_env.images")
    six = replace(task, extra={"install": {"pip": ["six==1.16.0"]}})
    image = task_image(six, client=daemon)
    with Sandbox(SandboxConfig(image=image, memory_mb=256)) as sb:
        assert sb.exec("python -c 'import six; print(six.__version__)'", timeout_s=60).output == "1.16.0\n"
    downloads = [r for r in caplog.records if r.getMessage().startswith("downloading wheels")]
    assert task_image(six, client=daemon) == image
    assert [r for r in caplog.records if r.getMessage().startswith("downloading wheels")] == downloads
    assert len(downloads) == 1
