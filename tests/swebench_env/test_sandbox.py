"""Sandboxes for real: commands, limits, timeouts, isolation, copying in, and clean-up after crashes.

The docker-marked tests need a daemon (see conftest.py). Nothing here sleeps and then asserts: waits
are on conditions with deadlines, since the machine is a busy 2-core box.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from swebench_env.docker_util import DockerUnavailable, docker_client
from swebench_env.grading import DockerGrader, DockerGraderConfig, GradingError, checkout_archive
from swebench_env.reaper import CREATED, LABEL, OWNER_PID, Owner, is_stale
from swebench_env.sandbox import Sandbox, SandboxConfig, SandboxError, _storage_options
from swebench_env.sandbox_files import copy_in, folder_archive
from swebench_env.suite import load_suite

ROOT = Path(__file__).resolve().parents[2]
# A child process that starts a sandbox, prints its name, and is in the middle of a command when killed.
OWNER_SCRIPT = """
import sys
from swebench_env.sandbox import Sandbox, SandboxConfig
sandbox = Sandbox(SandboxConfig(image=sys.argv[1], memory_mb=256)).start()
print(sandbox.name, flush=True)
sandbox.exec("sleep 600", timeout_s=900)
"""
# A child process that starts and closes one sandbox: a "next start-up" (its start runs the reaper).
NEXT_RUN_SCRIPT = """
import sys
from swebench_env.sandbox import Sandbox, SandboxConfig
with Sandbox(SandboxConfig(image=sys.argv[1], memory_mb=256)) as sandbox:
    assert sandbox.exec("true", 30).exit_code == 0
"""


# --- without Docker -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [("memory_mb", 8), ("cpus", 0), ("pids_limit", 2), ("command_timeout_s", 0), ("workdir", "rel"), ("image", "")]
    + [("disk_mb", 8), ("writable_paths", ("tmp",)), ("writable_paths", ("/",))],
)
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SandboxConfig(**{"image": "x", field: value})


def test_tmpfs_storage_is_charged_to_the_memory_limit_and_the_root_is_read_only():
    config = SandboxConfig(image="x", memory_mb=2048, disk_mb=512, writable_paths=("/testbed", "/tmp"))
    options, memory_mb = _storage_options(config, "tmpfs")
    assert memory_mb == 2048 + 512
    assert options == {"read_only": True, "tmpfs": {"/testbed": "size=512m,mode=755,exec",
                                                    "/tmp": "size=512m,mode=1777,exec"}}  # fmt: skip
    assert _storage_options(config, "storage_opt") == ({"storage_opt": {"size": "512m"}}, 2048)
    assert _storage_options(replace(config, disk_mb=None), None) == ({}, 2048)


def test_no_daemon_raises_docker_unavailable_saying_how_to_start_one():
    pytest.importorskip("docker")
    with pytest.raises(DockerUnavailable, match=r"dockerd .*\.ci/docker-setup"):
        docker_client(base_url="unix:///nonexistent/docker.sock")


def _labels(**owner) -> dict[str, str]:
    return {**Owner.current().labels(), **{f"seamlessflow.owner_{k}": str(v) for k, v in owner.items()}}


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_reaper_keeps_a_live_owners_sandbox():
    assert not is_stale(_labels(), Owner.current(), time.time())


def test_reaper_removes_a_dead_owners_sandbox():
    assert is_stale(_labels(pid=_dead_pid()), Owner.current(), time.time())


def test_reaper_removes_a_sandbox_whose_owner_pid_was_recycled():
    assert is_stale(_labels(start="1"), Owner.current(), time.time())


def test_reaper_removes_sandboxes_from_before_a_reboot():
    assert is_stale(_labels(boot="another-boot"), Owner.current(), time.time())


def test_reaper_leaves_other_hosts_sandboxes_alone():
    assert not is_stale(_labels(host="elsewhere", pid=_dead_pid()), Owner.current(), time.time())


def test_reaper_removes_other_hosts_sandboxes_past_a_given_age():
    labels = {**_labels(host="elsewhere"), CREATED: str(time.time() - 7200)}
    assert is_stale(labels, Owner.current(), time.time(), older_than_s=3600)


# --- with Docker --------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def no_leaked_containers():
    """No container started during this module outlives it: none of this process's, and none whose owner (a
    child the tests started and killed) is gone. A live process's sandboxes on the same daemon (another run or
    test job) are not this module's: the owner labels every sandbox carries tell them apart."""
    try:
        client = docker_client()
    except DockerUnavailable:
        yield
        return
    before = {c.name for c in client.containers.list(all=True)}
    yield
    here, now = Owner.current(), time.time()
    leaked = {c.name for c in client.containers.list(all=True, ignore_removed=True) if c.name not in before
              and (c.labels.get(OWNER_PID) == str(here.pid) or is_stale(c.labels, here, now))}  # fmt: skip
    assert not leaked


@pytest.fixture
def sandbox(sandbox_config):
    with Sandbox(sandbox_config) as sb:
        yield sb


@pytest.mark.docker
def test_exec_returns_the_exit_code(sandbox):
    assert sandbox.exec("exit 3", timeout_s=30).exit_code == 3


@pytest.mark.docker
def test_exec_merges_stdout_and_stderr_in_order(sandbox):
    assert sandbox.exec("echo one; echo two >&2; echo three", timeout_s=30).output == "one\ntwo\nthree\n"


@pytest.mark.docker
def test_exec_runs_in_the_given_workdir_with_the_given_env(sandbox):
    result = sandbox.exec('echo "$PWD $GREETING"', timeout_s=30, workdir="/tmp", env={"GREETING": "hi"})
    assert result.output == "/tmp hi\n"


@pytest.mark.docker
def test_a_missing_workdir_is_a_failed_result_not_an_exception(sandbox):
    assert sandbox.exec("true", timeout_s=30, workdir="/no/such/dir").exit_code != 0


@pytest.mark.docker
def test_output_is_truncated_to_the_limit_keeping_head_and_tail(sandbox_config):
    with Sandbox(replace(sandbox_config, output_limit_bytes=1000)) as sb:
        result = sb.exec("echo START; head -c 100000 /dev/zero | tr '\\0' a; echo; echo END", timeout_s=30)
    assert result.truncated
    assert len(result.output) < 1100
    assert result.output.startswith("START\n")
    assert result.output.endswith("\nEND\n")


@pytest.mark.docker
def test_sandbox_has_no_network_interface_but_loopback(sandbox):
    assert sandbox.exec("ls /sys/class/net", timeout_s=30).output.split() == ["lo"]


@pytest.mark.docker
def test_sandbox_cannot_reach_the_network(sandbox):
    connect = "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=5)'"
    assert sandbox.exec(connect, timeout_s=30).exit_code != 0


@pytest.mark.docker
def test_command_past_its_timeout_is_killed(sandbox):
    result = sandbox.exec("sleep 120", timeout_s=1)
    assert result.timed_out
    assert result.duration_s < 1 + sandbox.config.client_grace_s


@pytest.mark.docker
def test_sandbox_stays_usable_after_a_timeout(sandbox):
    sandbox.exec("sleep 120", timeout_s=1)
    assert sandbox.exec("echo ok", timeout_s=30).output == "ok\n"


@pytest.mark.docker
def test_background_processes_end_with_their_command(sandbox):
    pid = sandbox.exec("sleep 300 & echo $!", timeout_s=30).output.strip()
    assert sandbox.exec(f"kill -0 {pid}", timeout_s=30).exit_code != 0


@pytest.mark.docker
def test_a_setsid_process_holding_the_output_does_not_hold_exec(sandbox):
    result = sandbox.exec("setsid sh -c 'sleep 120' & echo started", timeout_s=60)
    assert result.output == "started\n"
    assert result.duration_s < 30


# Spawns processes with builtins only (no fork needed to count them), for 3 s, then counts them.
FORK_BOMB = """bomb() { bomb | bomb & }; bomb
SECONDS=0; while (( SECONDS < 3 )); do :; done
n=0; for p in /proc/[0-9]*; do n=$((n+1)); done; echo "processes=$n"
"""


@pytest.mark.docker
def test_fork_bomb_is_stopped_by_the_pids_limit(sandbox_config):
    with Sandbox(replace(sandbox_config, pids_limit=64)) as sb:
        result = sb.exec(FORK_BOMB, timeout_s=60)
        count = int(result.output.rsplit("processes=", 1)[1])
        # the bomb dies with its command, though not in an instant: its last processes may still be exiting (and
        # crowd `ps`'s own fork, whose retries the shell reports) when the next command starts
        deadline, left = time.monotonic() + 30, None
        while left is None or (left >= 10 and time.monotonic() < deadline):
            after = sb.exec("ps -e --no-headers | wc -l", timeout_s=30)
            left = int(after.output.strip().splitlines()[-1])
            time.sleep(0.1)
    assert 32 <= count <= 64  # the bomb reached the limit and no further
    assert left < 10  # and died with its command; the sandbox survived it


@pytest.mark.docker
def test_memory_hog_is_killed_and_the_sandbox_survives(sandbox_config):
    with Sandbox(replace(sandbox_config, memory_mb=256, disk_mb=64)) as sb:  # a 320 MB limit: tmpfs counts
        hog = sb.exec("python3 -c 'x = b\"a\" * (1 << 30)'", timeout_s=120)
        after = sb.exec("echo alive", timeout_s=30)
    assert (hog.exit_code, hog.timed_out) == (137, False)
    assert after.output == "alive\n"


@pytest.mark.docker
def test_a_write_past_the_disk_limit_fails_alone_and_the_sandbox_stays_usable(sandbox_config):
    with Sandbox(replace(sandbox_config, disk_mb=64)) as sb:
        full = sb.exec("dd if=/dev/zero of=/testbed/big bs=1M count=100", timeout_s=60)
        elsewhere = sb.exec("touch /opt/x /usr/x /x", timeout_s=30)
        after = sb.exec("rm /testbed/big && echo ok > /testbed/small && cat /testbed/small", timeout_s=30)
        assert sb.disk_limit in ("tmpfs", "storage_opt")
    assert (full.exit_code != 0, full.timed_out) == (True, False)
    assert "No space left on device" in full.output or "quota exceeded" in full.output
    assert elsewhere.exit_code != 0  # a read-only root (tmpfs) or the same quota (storage_opt)
    assert after.output == "ok\n"


@pytest.mark.docker
def test_the_image_content_of_the_writable_places_is_there(sandbox):
    assert sandbox.exec("test -f /root/.bashrc && test -d /tmp && echo ok", timeout_s=30).output == "ok\n"


@pytest.mark.docker
def test_copying_in_past_the_disk_limit_is_a_sandbox_error(sandbox_config, tmp_path):
    (tmp_path / "big.bin").write_bytes(os.urandom(40 << 20))
    with Sandbox(replace(sandbox_config, disk_mb=32)) as sb:
        with pytest.raises(SandboxError, match="copying files into /testbed failed: tar: "):
            copy_in(sb, tmp_path, "/testbed")
        assert sb.exec("echo alive", timeout_s=30).output == "alive\n"


@pytest.mark.docker
def test_a_full_sandbox_does_not_touch_the_grading_of_another_task(sandbox_config, base_image):
    task = next(t for t in load_suite("train") if t.instance_id == "swesuite__intervalset-3")
    grader = DockerGrader(DockerGraderConfig(image=base_image, test_timeout_s=120, memory_mb=1024))
    with Sandbox(replace(sandbox_config, disk_mb=64)) as sb:
        assert sb.exec("cat /dev/zero > /tmp/fill", timeout_s=60).exit_code != 0
        assert grader(task, task.patch).resolved
        assert grader(task, "").resolved is False


@pytest.mark.docker
def test_copy_in_copies_a_git_checkout(sandbox, tmp_path):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "mod.py").write_text("X = 1\n")
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t"}
    env |= {"GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    for argv in (["init", "-q"], ["add", "."], ["commit", "-qm", "first"]):
        subprocess.run(["git", *argv], cwd=repo, env=env, check=True)
    copy_in(sandbox, repo, "/testbed")
    assert sandbox.exec("cat pkg/mod.py", timeout_s=30, workdir="/testbed").output == "X = 1\n"
    assert sandbox.exec("git log --format=%s", timeout_s=30, workdir="/testbed").output == "first\n"
    assert sandbox.exec("git status --porcelain", timeout_s=30, workdir="/testbed").output == ""


@pytest.mark.docker
def test_an_archive_is_copied_in_to_a_folder_it_makes_and_a_file_in_the_way_is_a_sandbox_error(sandbox, tmp_path):
    (tmp_path / "a.txt").write_text("one\n")
    copy_in(sandbox, folder_archive(tmp_path), "/testbed/deep/er")
    assert sandbox.exec("cat /testbed/deep/er/a.txt && stat -c %U /testbed/deep/er/a.txt", timeout_s=30).output == (
        "one\nroot\n"
    )
    sandbox.exec("touch /tmp/file", timeout_s=30)
    with pytest.raises(SandboxError, match="copying files into /tmp/file/x failed: mkdir: "):
        copy_in(sandbox, folder_archive(tmp_path), "/tmp/file/x")
    with pytest.raises(ValueError, match="must be an absolute path"):
        copy_in(sandbox, b"", "relative")


def test_a_checkout_archive_is_made_once_a_commit_and_a_bad_commit_is_a_grading_error():
    from dataclasses import replace as changed

    task = load_suite("train")[0]
    first = checkout_archive(task)
    assert checkout_archive(task) is first  # kept: a training run copies each checkout in twice an episode
    with pytest.raises(GradingError, match=f"instance {task.instance_id!r}: its repository cannot be checked out"):
        checkout_archive(changed(task, base_commit="0" * 40))


@pytest.mark.docker
def test_close_removes_the_container_and_is_idempotent(daemon, sandbox_config):
    sb = Sandbox(sandbox_config).start()
    sb.close()
    sb.close()
    assert daemon.containers.list(all=True, filters={"name": sb.name}) == []


@pytest.mark.docker
@pytest.mark.parametrize("shell", [True, False], ids=["shell", "docker-exec"])
def test_closing_a_sandbox_ends_a_running_commands_wait_at_once(sandbox_config, shell):
    """A stopping run (Ctrl-C) closes its sandboxes while their commands run in worker threads, and waits for
    those threads: each must return as soon as its sandbox is gone, not at its command's deadline (here 300 s
    plus the client's grace)."""
    sb = Sandbox(sandbox_config).start()
    try:
        if shell:  # commands through the sandbox's command runner; else one `docker exec` each
            assert sb.start_shell()
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(sb.exec, "echo started; sleep 300", timeout_s=300)
            deadline = time.monotonic() + 60
            while not _running_sleep(sb) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _running_sleep(sb), "the command never started"
            sb.close()
            try:
                result = running.result(timeout=60)  # the old wait: 305 s
            except SandboxError as e:
                assert "not running" in str(e)
            else:
                assert result.exit_code != 0 and not shell, result  # docker exec: the killed command's status
    finally:
        sb.close()


def _running_sleep(sb: Sandbox) -> bool:
    try:
        return "sleep 300" in " ".join(" ".join(p) for p in docker_client().api.top(sb.name)["Processes"])
    except Exception:
        return False


@pytest.mark.docker
def test_exec_in_a_closed_sandbox_raises_sandbox_error(sandbox_config):
    sb = Sandbox(sandbox_config).start()
    sb.close()
    with pytest.raises(SandboxError, match="not running"):
        sb.exec("true", timeout_s=30)


@pytest.mark.docker
def test_sandboxes_carry_our_label_and_owner(daemon, sandbox):
    labels = daemon.containers.get(sandbox.name).labels
    assert (labels[LABEL], labels["seamlessflow.owner_pid"]) == ("1", str(os.getpid()))


@pytest.mark.docker
def test_many_sandboxes_at_once(sandbox_config):
    def run(i: int) -> str:
        with Sandbox(sandbox_config) as sb:
            return sb.exec(f"echo {i}", timeout_s=60).output

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(run, range(4))) == [f"{i}\n" for i in range(4)]


def _spawn(script: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def _first_line(proc: subprocess.Popen, timeout_s: float = 120) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            proc.kill()
            pytest.fail(f"the child printed nothing in {timeout_s} s")
    return proc.stdout.readline().strip()


def _exists(daemon, name: str) -> bool:
    return bool(daemon.containers.list(all=True, filters={"name": f"^{name}$"}))


@pytest.mark.docker
def test_sigkilled_owner_leaves_nothing_after_the_next_startup(daemon, base_image):
    owner = _spawn(OWNER_SCRIPT, base_image)
    name = _first_line(owner)
    owner.kill()
    owner.wait(timeout=60)
    assert _exists(daemon, name)  # SIGKILL: no clean-up ran
    next_run = _spawn(NEXT_RUN_SCRIPT, base_image)
    assert next_run.wait(timeout=120) == 0
    assert not _exists(daemon, name)


@pytest.mark.docker
def test_sigterm_removes_the_owners_sandboxes(daemon, base_image):
    owner = _spawn(OWNER_SCRIPT, base_image)
    name = _first_line(owner)
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=120) == 128 + signal.SIGTERM
    assert not _exists(daemon, name)
