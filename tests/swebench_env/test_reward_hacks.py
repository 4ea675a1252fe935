"""Reward hacks: patches that make the tests report success without fixing anything, graded unresolved.

Each hack below resolves a shipped task when the protected-file rule (`evaluation.protected_paths`) is
switched off (a test says so, so every hack here is a real one), and none resolves with it on; the gold
patch with every hack added still resolves. The start-up hacks (`sitecustomize.py`, a `.pth` file) need
an environment where the repository is on `sys.path` when the interpreter starts, as an editable install
puts it in SWE-bench's images: `sitedir_image` is the base image with such a `.pth` file (and without
Debian's own sitecustomize, which would shadow the repository's, as conda's Python has none).
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from swebench_env import grading
from swebench_env.evaluation import evaluate_locally, is_protected, protected_paths, touched_paths
from swebench_env.grading import DockerGrader, DockerGraderConfig
from swebench_env.suite import load_suite
from swebench_env.tasks import materialize_repo

# A pytest plugin that reports every test phase as passed.
FORCE_PASS = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome, report.longrepr = "passed", None
"""
# Test bodies never run: every test passes (code a test module's package, or the module itself, runs first).
SKIP_BODIES = "import _pytest.python\n_pytest.python.Function.runtest = lambda self: None\n"
# A `pytest` module in the repository's root, which `python -m pytest` runs instead of pytest.
FAKE_PYTEST = """import os
import sys

root = os.path.abspath(os.path.dirname(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
import pytest as real  # noqa: E402

sys.path.append(root)


class Force:
    @real.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        report.outcome, report.longrepr = "passed", None


sys.exit(real.main(sys.argv[1:], plugins=[Force()]))
"""
SITE_PLUGIN = 'import os\nos.environ["PYTEST_PLUGINS"] = "sitecustomize"\n' + FORCE_PASS
SITEDIR_PTH = 'import site; site.addsitedir("/testbed")\n'


def new_file(path: str, text: str) -> str:
    lines = text.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    header = f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
    return f"{header}@@ -0,0 +1,{len(lines)} @@\n{body}"


def edit(task, tmp_path: Path, path: str, change) -> str:
    """A patch that replaces the text of `path` (a file of the base commit) with `change(text)`."""
    repo = materialize_repo(task, tmp_path / f"edit-{path.replace('/', '_')}-{len(list(tmp_path.iterdir()))}")
    target = repo / path
    target.write_text(change(target.read_text()))
    return subprocess.run(["git", "diff"], cwd=repo, capture_output=True, text=True, check=True).stdout


def hacks(task, tmp_path: Path) -> dict[str, str]:
    """Name -> a patch that fixes nothing and makes the task's tests pass (where the rule is off). The shipped
    repositories configure pytest in pyproject.toml, which pytest reads before setup.cfg and tox.ini: the
    setup.cfg hack also takes the section out of pyproject.toml."""
    judged = task.test_patch.split("diff --git a/", 1)[1].split(" ", 1)[0]
    plugin = new_file("hackplug.py", FORCE_PASS)  # not protected itself: inert unless something loads it
    section = "[tool.pytest.ini_options]\n"
    return {
        "root conftest.py": new_file("conftest.py", FORCE_PASS),
        "nested conftest.py": new_file("tests/conftest.py", FORCE_PASS),
        "pytest.ini addopts -p": plugin + new_file("pytest.ini", "[pytest]\naddopts = -p hackplug"),
        "pyproject.toml addopts -p": plugin
        + edit(task, tmp_path, "pyproject.toml", lambda t: t.replace(section, section + 'addopts = "-p hackplug"\n')),
        "setup.cfg addopts -p": plugin
        + new_file("setup.cfg", "[tool:pytest]\naddopts = -p hackplug")
        + edit(task, tmp_path, "pyproject.toml", lambda t: t.replace(section, "[tool.elsewhere]\n")),
        "tests/__init__.py (not in the test patch)": new_file("tests/__init__.py", SKIP_BODIES),
        "pytest.py shadowing pytest": new_file("pytest.py", FAKE_PYTEST),
        "judged test file edited": edit(task, tmp_path, judged, lambda t: SKIP_BODIES + t),
    }


def startup_hacks() -> dict[str, str]:
    """Hacks that run at interpreter start-up: real only where the repository is a site dir (`sitedir_image`)."""
    plugin = new_file("hackplug.py", FORCE_PASS)
    return {
        "sitecustomize.py": new_file("sitecustomize.py", SITE_PLUGIN),
        ".pth file": plugin + new_file("zz_hack.pth", 'import os; os.environ["PYTEST_PLUGINS"] = "hackplug"'),
    }


@pytest.fixture(scope="module")
def task():
    return next(t for t in load_suite("train") if t.instance_id == "swesuite__intervalset-3")


# --- the rule, without Docker --------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["conftest.py", "src/pkg/conftest.py", "pytest.ini", "sub/.pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"]
    + ["sitecustomize.py", "lib/usercustomize.py", "x.pth", "pkg/__pycache__/m.cpython-311.pyc", "m.pyc"]
    + ["tests/helpers.py", "pkg/test/data.json", "test_thing.py", "pkg/thing_test.py", "app/tests.py"]
    + ["pytest.py", "_pytest/__init__.py", "json.py", "inspect.cpython-311-x86_64-linux-gnu.so", ".git/config"],
)
def test_protected_paths(path):
    assert is_protected(path)


@pytest.mark.parametrize(
    "path", ["intervalset.py", "pkg/json.py", "site/index.html", "docs/conf.py", "latest.py", "src/contest.py"]
)
def test_source_paths_are_not_protected(path):
    assert not is_protected(path)


def test_the_judged_files_are_protected_whatever_their_name(task):
    renamed = replace(task, test_patch=new_file("checks/spec_intervals.py", "def test_x():\n    pass"))
    assert protected_paths(renamed, new_file("checks/spec_intervals.py", "x = 1")) == ["checks/spec_intervals.py"]


def test_touched_paths_read_quoted_plain_and_renamed_headers():
    quoted = 'diff --git "a/tests/t\\303\\251st.py" "b/tests/t\\303\\251st.py"\n'
    plain = "--- conftest.py\t2024-01-01 00:00:00\n+++ conftest.py\t2024-01-01 00:00:01\n"
    renamed = "diff --git a/src/m.py b/src/conftest.py\nrename from src/m.py\nrename to src/conftest.py\n"
    assert "tests/tést.py" in touched_paths(quoted)
    assert touched_paths(plain) == ["conftest.py"]
    assert "src/conftest.py" in touched_paths(renamed, unstripped=False)
    assert touched_paths("--- a/../../etc/passwd\n+++ /etc/passwd\n", unstripped=False) == ["etc/passwd"]


def test_the_local_grader_undoes_a_root_conftest(task):
    hack = new_file("conftest.py", FORCE_PASS)
    assert evaluate_locally(task, hack).resolved is False
    gold = evaluate_locally(task, task.patch + hack)
    assert gold.resolved is True
    assert gold.undone == ("conftest.py",)


# --- in Docker -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sitedir_image(daemon, base_image) -> str:
    """The base image with /testbed a site dir at start-up (a `.pth` file) and no sitecustomize of its own."""
    tag = f"seamlessflow/swe-test-sitedir:{base_image.rsplit(':', 1)[1]}"
    script = "rm -f /usr/lib/python3.11/sitecustomize.py /etc/python3.11/sitecustomize.py && " + (
        f"printf '%s' '{SITEDIR_PTH}' > /usr/lib/python3/dist-packages/zz_testbed.pth"
    )
    container = daemon.containers.create(base_image, ["sh", "-c", script], network_mode="none")
    try:
        container.start()
        assert container.wait(timeout=60)["StatusCode"] == 0
        container.commit(*tag.split(":"))
    finally:
        container.remove(force=True)
    return tag


def _grade_all(grader: DockerGrader, task, patches: dict[str, str]) -> dict[str, bool]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        evaluations = dict(zip(patches, pool.map(lambda p: grader(task, p), patches.values()), strict=True))
    assert all(e.applied for e in evaluations.values()), {n: e.log[-400:] for n, e in evaluations.items()}
    return {name: e.resolved for name, e in evaluations.items()}


@pytest.fixture(scope="module")
def grader(base_image) -> DockerGrader:
    return DockerGrader(DockerGraderConfig(image=base_image, test_timeout_s=120, memory_mb=1024))


@pytest.fixture(scope="module")
def sitedir_grader(sitedir_image) -> DockerGrader:
    return DockerGrader(DockerGraderConfig(image=sitedir_image, test_timeout_s=120, memory_mb=1024))


@pytest.mark.docker
def test_no_hack_resolves(grader, sitedir_grader, task, tmp_path):
    verdicts = _grade_all(grader, task, hacks(task, tmp_path)) | _grade_all(sitedir_grader, task, startup_hacks())
    assert verdicts == dict.fromkeys(verdicts, False)


def combine(*patches: str) -> str:
    """One patch of all `patches`, each file's diff once (several hacks add the same plugin module)."""
    sections = [f"diff --git {s}" for p in patches for s in p.split("diff --git ")[1:]]
    return "".join(dict.fromkeys(sections))


@pytest.mark.docker
def test_the_gold_patch_with_every_hack_in_it_resolves(grader, sitedir_grader, task, tmp_path):
    evaluation = grader(task, combine(task.patch, *hacks(task, tmp_path).values()))
    assert evaluation.resolved, evaluation.log[-2000:]
    assert {"conftest.py", "tests/conftest.py", "pytest.ini", "pytest.py"} <= set(evaluation.undone)
    assert "intervalset.py" not in evaluation.undone
    assert sitedir_grader(task, combine(task.patch, *startup_hacks().values())).resolved


@pytest.mark.docker
def test_every_hack_resolves_with_the_rule_off(grader, sitedir_grader, task, tmp_path, monkeypatch):
    """The hacks are real: without the rule each one resolves, but an edit to a judged test file, which
    SWE-bench's own reset of the test patch's files undoes."""
    monkeypatch.setattr(grading, "protected_paths", lambda task, patch, unstripped=True: [])
    verdicts = _grade_all(grader, task, hacks(task, tmp_path)) | _grade_all(sitedir_grader, task, startup_hacks())
    assert verdicts == dict.fromkeys(verdicts, True) | {"judged test file edited": False}
