"""Grading in Docker: every prediction in a fresh sandbox, by SWE-bench's procedure, in SWE-bench's log format.

`DockerGrader` is a `Grader` ((task, patch) -> Evaluation) for rollouts and for `eval`. Per call it
starts a sandbox (no network, memory/CPU/pids limits), puts the task's repository at /testbed at its
base commit, and runs one script there that does what SWE-bench's `run_instance` and eval script do:

1. apply the candidate patch with `git apply`, or failing that `patch --batch --fuzz=5 -p1` (SWE-bench's
   fallbacks); if neither applies, log `>>>>> Patch Apply Failed` and stop;
2. undo what the patch did to protected paths (`evaluation.protected_paths`: test configuration such as
   `conftest.py` or `pyproject.toml`, interpreter start-up files such as `sitecustomize.py` or `*.pth`,
   test files, modules shadowing pytest's or the standard library's): each is put back as it was before
   the patch (saved in a tar first; removed if the patch added it) and the log names them
   (`>>>>> Undid Protected Changes: ...`). This departs from SWE-bench, whose harness lets a patch that
   adds a root `conftest.py` forcing every test to pass resolve the task; see `evaluation.py` for the
   whole rule, why it resets rather than rejects, and what it does not catch (source code that patches
   pytest when the tests import it);
3. reset the files the test patch touches to the base commit (so a patch cannot edit its judges) and
   apply the test patch;
4. run the tests between `>>>>> Start Test Output` and `>>>>> End Test Output`, under `timeout`, with
   plugin auto-loading off and `PYTEST_ADDOPTS` / `PYTEST_PLUGINS` unset, and log `>>>>> Test Exit
   Code: N` and `>>>>> Tests Timed Out` when the timeout struck (exit 124 after SIGTERM, or 137 after
   the SIGKILL that follows `KILL_GRACE_S` later when SIGTERM was ignored).

Official SWE-bench records get steps 1-2 from us and the rest from their own eval script. The sandbox's
writable storage is limited (`disk_mb`; see `sandbox.py`).

The log is read by `evaluation.read_eval_log` and graded by `evaluation.grade` (SWE-bench's rules), so
the `swebench` package's `get_eval_report` reads the same log the same way; `swebench_resolved` asks
it, and `eval` reports any instance where the two disagree.

Two kinds of task:
- a task with a local repository (`repo_path`: the shipped suite, users' own tasks) runs in the base
  image (`images.ensure_base_image`, built offline), the checkout copied in; its tests run with pytest;
- an official SWE-bench instance that carries its own `eval_script` and `log_parser` (SWE-bench's
  dataset records do) runs that script in the instance's image (its `image` field, or the official
  `swebench/sweb.eval.*` name, pulled if absent) and is parsed by the `swebench` package's parser.
  Nothing can be pulled on a machine without a registry, so that path is tested only where one is.

`GradingError` means the task could not be graded (its repository cannot be checked out, its test patch
does not apply, the sandbox failed): no verdict on the patch, so a rollout stores no reward for it.
"""

from __future__ import annotations

import shlex
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from swebench_env.evaluation import (
    APPLY_PATCH_FAIL,
    APPLY_PATCH_PASS,
    END_TEST_OUTPUT,
    RESET_FAILED,
    START_TEST_OUTPUT,
    TEST_EXIT_CODE,
    TESTS_TIMEOUT,
    Evaluation,
    Outcome,
    grade,
    judged_files,
    parse_pytest_log,
    protected_paths,
    pytest_command,
    read_eval_log,
)
from swebench_env.git import GitError
from swebench_env.sandbox import Sandbox, SandboxConfig, SandboxError
from swebench_env.sandbox_files import copy_in, folder_archive, write_files
from swebench_env.tasks import Instance, is_official, materialize_repo

TESTBED = "/testbed"  # where the repository lies in a sandbox, as in SWE-bench's images
SCRATCH = "/tmp/swe"  # the patches and the script
TEST_PATCH_FAIL = ">>>>> Test Patch Apply Failed"  # the task's own test patch: a broken task, not a bad patch
KILL_GRACE_S = 10  # `timeout -k`: SIGKILL this long after SIGTERM
PROTECTED_TAR = f"{SCRATCH}/protected.tar"  # the protected paths as they were before the candidate patch
UNDONE = ">>>>> Undid Protected Changes"  # our marker (not SWE-bench's): what the candidate may not change
# Options and plugins from outside the repository off; no bytecode, so nothing the run writes is reused.
_CLEAN_ENV = [
    "export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONDONTWRITEBYTECODE=1",
    "unset PYTEST_ADDOPTS PYTEST_PLUGINS",
]


class GradingError(RuntimeError):
    """The task could not be graded: no verdict on the patch. The message names the instance and why."""


ARCHIVE_CACHE_BYTES = 256 << 20  # checkouts kept as tars in memory (a training run copies each one in many times)
ARCHIVE_MAX_BYTES = 16 << 20  # a larger checkout is made afresh each time
_archives: OrderedDict[tuple[str, str], bytes] = OrderedDict()  # (source, base commit) -> tar, least recent first
_archives_lock = threading.Lock()


def checkout_archive(task: Instance) -> bytes:
    """`task`'s repository at its base commit (`materialize_repo`) as the tar that `copy_in` unpacks at /testbed.

    A commit names its content, so the tar is kept per (repository source, base commit), up to
    `ARCHIVE_CACHE_BYTES` in all, least recently used first out: each episode of a training run needs the same
    checkout twice (workspace and grader), and making it costs three git processes. Raises GradingError when
    the repository cannot be checked out."""
    key = (str(task.repo_path) if task.repo_path is not None else task.repo, task.base_commit)
    with _archives_lock:
        if (cached := _archives.get(key)) is not None:
            _archives.move_to_end(key)
            return cached
    with tempfile.TemporaryDirectory(prefix=f"checkout-{task.instance_id}-") as tmp:
        try:
            archive = folder_archive(materialize_repo(task, Path(tmp) / "repo"))
        except GitError as e:
            raise GradingError(f"instance {task.instance_id!r}: its repository cannot be checked out: {e}") from e
    if len(archive) <= ARCHIVE_MAX_BYTES:
        with _archives_lock:
            _archives[key] = archive
            while sum(map(len, _archives.values())) > ARCHIVE_CACHE_BYTES:
                _archives.popitem(last=False)
    return archive


@dataclass(frozen=True)
class DockerGraderConfig:
    image: str | None = None  # image for tasks with a local repository (None: the offline base image)
    test_timeout_s: float = 300.0  # the test run; past it the log says "Tests Timed Out" and nothing passes
    memory_mb: int = 2048
    cpus: float = 1.0
    pids_limit: int = 512
    disk_mb: int | None = 1024  # writable storage (SandboxConfig.disk_mb: tmpfs, charged on top of memory_mb)
    output_limit_bytes: int = 4 * 1024 * 1024  # log kept per run (first and last halves)

    def sandbox(self, image: str, task: Instance, labels: dict[str, str]) -> SandboxConfig:
        """The sandbox a grading of `task` runs in: these limits, in the task's repository (an official
        instance's testbed, else the root)."""
        return SandboxConfig(
            image=image,
            memory_mb=self.memory_mb,
            cpus=self.cpus,
            pids_limit=self.pids_limit,
            workdir=TESTBED if is_official(task) else "/",
            output_limit_bytes=self.output_limit_bytes,
            disk_mb=self.disk_mb,
            labels=labels,
        )

    def __post_init__(self) -> None:
        if not self.test_timeout_s > 0:
            raise ValueError(f"test_timeout_s={self.test_timeout_s!r} must be positive")


def _apply_candidate(protected: list[str]) -> list[str]:
    """Apply the candidate patch, with what it does to `protected` paths undone (see `_save` and `_restore`)."""
    patch = f"{SCRATCH}/model.patch"
    return [
        *_save(protected),
        f"if [ -s {patch} ]; then",
        f"  if ! git apply --whitespace=nowarn {patch} && ! patch --batch --fuzz=5 -p1 -i {patch}; then",
        f'    echo "{APPLY_PATCH_FAIL}"; exit 0',
        "  fi",
        "fi",
        f'echo "{APPLY_PATCH_PASS}"',
        *_restore(protected),
    ]


def _save(protected: list[str]) -> list[str]:
    """Before the candidate: the protected paths it may touch (`evaluation.protected_paths`) that exist, in a tar."""
    if not protected:
        return []
    return [
        f"protected=({' '.join(map(shlex.quote, protected))})",
        "saved=()",
        'for p in "${protected[@]}"; do if [ -e "$p" ] || [ -L "$p" ]; then saved+=("$p"); fi; done',
        f'if [ ${{#saved[@]}} -gt 0 ]; then tar -cf {PROTECTED_TAR} -- "${{saved[@]}}" || {{',
        f'  echo "{RESET_FAILED}"; exit 0; }}; fi',
    ]


def _restore(protected: list[str]) -> list[str]:
    """After the candidate: the protected paths as they were before it (removed when they did not exist)."""
    if not protected:
        return []
    return [
        'rm -rf -- "${protected[@]}"',
        f'if [ ${{#saved[@]}} -gt 0 ]; then tar -xf {PROTECTED_TAR} || {{ echo "{RESET_FAILED}"; exit 0; }}; fi',
    ]


def eval_script(task: Instance, test_timeout_s: float, patch: str = "") -> str:
    """The bash script that grades `patch` for a task with a local repository (see the module docstring)."""
    base = shlex.quote(task.base_commit)
    lines = ["set -uo pipefail", f"cd {TESTBED}", *_CLEAN_ENV]
    lines += _apply_candidate(protected_paths(task, patch))
    undone = protected_paths(task, patch, unstripped=False)
    if undone:
        lines.append("echo " + shlex.quote(f"{UNDONE}: {' '.join(undone)}"))
    for path in map(shlex.quote, judged_files(task)):
        lines.append(f"if git cat-file -e {base}:{path} 2>/dev/null; then")
        lines.append(f'  git checkout -q {base} -- {path} || {{ echo "{RESET_FAILED}"; exit 0; }}')
        lines.append(f"else rm -rf -- {path}; fi")
    lines.append(f'git apply --whitespace=nowarn {SCRATCH}/test.patch || {{ echo "{TEST_PATCH_FAIL}"; exit 0; }}')
    lines.append(f'echo "{START_TEST_OUTPUT}"')
    lines += _timed(shlex.join(pytest_command(task)), test_timeout_s)
    return "\n".join(lines) + "\n"


def _timed(command: str, timeout_s: float) -> list[str]:
    """Run `command` under `timeout`, SIGKILLed `KILL_GRACE_S` after the SIGTERM it ignored; either way the log
    says `Tests Timed Out` (`timeout` exits 124 after a SIGTERM, 137 after a SIGKILL; a 137 before the time
    is up is the OOM killer, not a timeout)."""
    return [
        "start=$SECONDS",
        f"timeout -k {KILL_GRACE_S} {timeout_s:g} {command}",
        "rc=$?",
        f'echo "{END_TEST_OUTPUT}"',
        f'echo "{TEST_EXIT_CODE}: $rc"',
        f'if [ "$rc" -eq 124 ] || {{ [ "$rc" -eq 137 ] && [ $((SECONDS - start)) -ge {int(timeout_s)} ]; }}; then',
        f'  echo "{TESTS_TIMEOUT}"',
        "fi",
    ]


def official_script(task: Instance, patch: str = "") -> tuple[str, Callable[[str], dict[str, Outcome]]]:
    """(script, log parser) for an official SWE-bench record: the candidate applied, then its own eval script
    (with the test exit code recorded, as SWE-bench's `make_test_spec` does); parsed by its named parser."""
    try:
        from swebench.harness.log_parsers import PARSER_REGISTRY
        from swebench.harness.utils import make_test_spec
    except ImportError:
        raise GradingError(
            f"instance {task.instance_id!r} is an official SWE-bench record: grading it needs the swebench package "
            '(pip install -e ".[swe]")'
        ) from None
    record = task.to_dict() | {"image": task.extra.get("image", "")}
    try:
        spec = make_test_spec(record)
        parser = PARSER_REGISTRY[spec.log_parser]
    except (KeyError, ValueError, TypeError) as e:
        raise GradingError(f"instance {task.instance_id!r}: cannot read its SWE-bench evaluation fields: {e!r}") from e
    candidate = _apply_candidate(protected_paths(task, patch))
    script = "\n".join(["set -uo pipefail", f"cd {TESTBED}", *candidate, spec.eval_script]) + "\n"

    def parse(log: str) -> dict[str, Outcome]:
        known = {o.value for o in Outcome}
        return {t: Outcome(s) for t, s in parser(log, spec).items() if s in known}

    return script, parse


def evaluation_from_log(task: Instance, log: str, parse=parse_pytest_log, patch: str = "") -> Evaluation:
    """Grade a run's log; GradingError when the task's own test patch did not apply."""
    if TEST_PATCH_FAIL in log:
        raise GradingError(f"instance {task.instance_id!r}: its test patch does not apply at its base commit")
    statuses, problem = read_eval_log(log, parse)
    applied = APPLY_PATCH_FAIL not in log
    undone = tuple(protected_paths(task, patch, unstripped=False)) if applied else ()
    return Evaluation(task.instance_id, applied, statuses, grade(task, statuses), log, problem, undone)


def swebench_resolved(task: Instance, log: str, patch: str) -> bool | None:
    """The `swebench` package's verdict on the same log (its `get_eval_report`), or None without the package."""
    try:
        from swebench.harness.grading import get_eval_report
        from swebench.types import TestSpec
    except ImportError:
        return None
    parser = task.extra.get("log_parser", "parse_log_pytest")
    spec = TestSpec(
        task.instance_id,
        "",
        [],
        task.repo,
        task.version,
        list(task.FAIL_TO_PASS),
        list(task.PASS_TO_PASS),
        parser,
        task.extra.get("eval_type", "pass_and_fail"),
    )
    prediction = {"instance_id": task.instance_id, "model_patch": patch, "model_name_or_path": "check"}
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(log)
        f.flush()
        return bool(get_eval_report(spec, prediction, f.name, include_tests_status=False)[task.instance_id]["resolved"])


class DockerGrader:
    """A `Grader`: each call grades one (task, patch) in a fresh sandbox; safe to call from many threads."""

    def __init__(self, config: DockerGraderConfig | None = None, client=None) -> None:
        self.config = config or DockerGraderConfig()
        self._client = client
        self._base_image = self.config.image

    def __call__(self, task: Instance, patch: str) -> Evaluation:
        if is_official(task):
            script, parse = official_script(task, patch)
            with self._sandbox(task) as sandbox:
                return evaluation_from_log(task, self._run(sandbox, task, patch, script), parse, patch)
        repo = checkout_archive(task)
        with self._sandbox(task) as sandbox:
            copy_in(sandbox, repo, TESTBED)
            log = self._run(sandbox, task, patch, eval_script(task, self.config.test_timeout_s, patch))
        return evaluation_from_log(task, log, patch=patch)

    def _run(self, sandbox: Sandbox, task: Instance, patch: str, script: str) -> str:
        write_files(sandbox, SCRATCH, {"model.patch": patch, "test.patch": task.test_patch, "eval.sh": script})
        result = sandbox.exec(f"bash {SCRATCH}/eval.sh", timeout_s=self.config.test_timeout_s + 2 * KILL_GRACE_S + 60)
        return result.output + (f"\n{TESTS_TIMEOUT}\n" if result.timed_out else "")

    @contextmanager
    def _sandbox(self, task: Instance) -> Iterator[Sandbox]:
        labels = {"seamlessflow.role": "grader", "seamlessflow.instance": task.instance_id}
        config = self.config.sandbox(self._image(task), task, labels)
        try:
            with Sandbox(config, self._client) as sandbox:
                yield sandbox
        except SandboxError as e:
            raise GradingError(f"instance {task.instance_id!r}: the sandbox failed: {e}") from e

    def _image(self, task: Instance) -> str:
        from swebench_env.images import task_image  # the task's own image, install recipe, or the default

        return task_image(task, self._base_image, client=self._client)


@contextmanager
def docker_workspace(
    task: Instance, *, image: str | None = None, client=None, limits: Mapping[str, object] | None = None
) -> Iterator[Sandbox]:
    """A sandbox with `task`'s repository at /testbed (its base commit), commands running there: the `Workspace`
    a rollout gives its agent. `limits`: SandboxConfig fields (memory_mb, cpus, pids_limit, ...)."""
    grader = DockerGrader(DockerGraderConfig(image=image), client)
    config = SandboxConfig(
        image=grader._image(task),
        workdir=TESTBED,
        labels={"seamlessflow.role": "agent", "seamlessflow.instance": task.instance_id},
        **dict(limits or {}),
    )
    with Sandbox(config, client) as sandbox:
        if not is_official(task):
            copy_in(sandbox, checkout_archive(task), TESTBED)
        sandbox.start_shell()  # the agent's commands: one docker exec for all of them (`swebench_env.shell`)
        yield sandbox
