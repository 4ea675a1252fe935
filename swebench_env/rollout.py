"""Rollouts: run an agent on tasks against a running trajectory manager, grade each episode, store its reward.

    python -m swebench_env rollout --tasks FILE --agent builtin|mini-swe-agent --base-url http://HOST:PORT \\
        --out DIR [--sandbox docker|local] [--concurrency N] [--admin-token-file F]

Per task, `run_instance` opens a workspace (a checkout with a runner in it), runs one agent episode
in its own manager session, grades the episode's patch and annotates the session with the reward
(`POST /trajectories/<session_id>` with the admin token, when the manager has one). Episodes run
`concurrency` at a time, in threads (the agent's calls and commands block, the GIL is free meanwhile).

Two seams make it independent of where commands run and how patches are judged: a `Workspace` opens a
`CommandRunner` for a task, a `Grader` turns (task, patch) into an `Evaluation`. `--sandbox docker` (the
default) gives each episode a Docker sandbox with the checkout at /testbed and grades in a fresh one, both
from a `pool.SandboxPool` that starts containers ahead of the episodes (`pooled_environment`; without a pool:
`grading.docker_workspace` and `grading.DockerGrader`); `--sandbox local` runs commands and tests on this
machine (`local_workspace`, `evaluation.evaluate_locally`): no isolation, for trusted tasks only.

An episode that ended on an API error (the manager unreachable or failing), or an instance whose
workspace, agent or grader raised, gets no reward: it says nothing about the policy, and a 0 would
teach it something false. Its result line says why.

Outputs in DIR: `results.jsonl` (one line an instance, in order of completion, written as they finish),
`summary.json` (pass@1 and exit reasons) and `config.json` (the resolved configuration, without token).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from core.errors import UserError, unknown_name
from core.outputs import prepare_out, show_progress
from swebench_env.agent import AgentConfig, BashAgent, Episode, ExitReason
from swebench_env.evaluation import Evaluation, evaluate_locally
from swebench_env.runner import CommandRunner, LocalRunner
from swebench_env.tasks import Instance, materialize_repo

Grader = Callable[[Instance, str], Evaluation]  # (task, patch) -> its evaluation
Workspace = Callable[[Instance], AbstractContextManager[CommandRunner]]  # a runner in a fresh checkout of the task
ANNOTATION_RETRIES = 3


class Agent(Protocol):
    def run(self, task: Instance, runner: CommandRunner, manager_url: str, session_id: str) -> Episode: ...


def _mini_swe_agent(config: AgentConfig, config_file: str | Path | None = None) -> Agent:
    from swebench_env.mini_swe import MiniSweAgent  # imports mini-swe-agent only when chosen

    return MiniSweAgent(config, config_file=config_file)


AGENTS: dict[str, Callable[[AgentConfig], Agent]] = {"builtin": BashAgent, "mini-swe-agent": _mini_swe_agent}
SANDBOXES = ("docker", "local")
CLI_SPARES = 1  # `rollout --sandbox docker`: containers of each kind (workspace, grader) started ahead


def make_agent(name: str, config: AgentConfig) -> Agent:
    """The agent registered as `name`; a UserError listing the choices for an unknown one."""
    if name not in AGENTS:
        raise unknown_name("agent", name, AGENTS)
    return AGENTS[name](config)


@contextmanager
def local_workspace(task: Instance) -> Iterator[LocalRunner]:
    """A `LocalRunner` in a temporary checkout of `task` at its base commit (no isolation: see runner.py)."""
    with tempfile.TemporaryDirectory(prefix=f"swe-{task.instance_id}-") as tmp:
        yield LocalRunner(materialize_repo(task, Path(tmp) / "repo"))


def environment(
    sandbox: str, image: str | None = None, test_timeout_s: float | None = None
) -> tuple[Workspace, Grader]:
    """The (workspace, grader) pair of a `--sandbox` choice; `image`: the Docker image for local-repository tasks;
    `test_timeout_s`: the grader's limit on a test run (None: its default)."""
    if sandbox == "local":
        if test_timeout_s is None:
            return local_workspace, evaluate_locally
        return local_workspace, functools.partial(evaluate_locally, timeout_s=test_timeout_s)
    if sandbox != "docker":
        raise unknown_name("sandbox", sandbox, SANDBOXES)
    from swebench_env.grading import DockerGrader, DockerGraderConfig, docker_workspace

    limits = {} if test_timeout_s is None else {"test_timeout_s": test_timeout_s}
    return functools.partial(docker_workspace, image=image), DockerGrader(DockerGraderConfig(image=image, **limits))


def pooled_environment(pool, image: str | None = None, test_timeout_s: float | None = None) -> tuple[Workspace, Grader]:
    """The (workspace, grader) pair of `--sandbox docker` with containers from a `pool.SandboxPool` (started
    ahead, at most its slots at once); each call has its own `EpisodeSandboxes`, so the pair may be shared."""

    def workspace(task: Instance) -> AbstractContextManager[CommandRunner]:
        return pool.episode(image, test_timeout_s).workspace(task)

    def grader(task: Instance, patch: str) -> Evaluation:
        return pool.episode(image, test_timeout_s).grader(task, patch)

    return workspace, grader


@dataclass(frozen=True)
class SweRolloutConfig:
    manager_url: str  # http://HOST:PORT of the trajectory manager (not a session's /s/<id>/v1 URL)
    concurrency: int = 4  # episodes at once
    run_id: str = ""  # session ids are "<run_id>:<instance_id>"; "" draws a fresh one
    admin_token: str | None = None  # the manager's admin token, needed to annotate when it has one
    author: str = "swebench_env.rollout"  # recorded with every annotation
    http_timeout_s: float = 30.0  # each annotation call

    def __post_init__(self) -> None:
        url = self.manager_url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"manager URL {self.manager_url!r} must start with http:// or https://")
        if url.endswith("/v1") or "/s/" in url:
            raise ValueError(f"give the manager's root URL (http://HOST:PORT), not a session URL: {self.manager_url!r}")
        object.__setattr__(self, "manager_url", url)
        if not self.run_id:
            object.__setattr__(self, "run_id", f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.admin_token is not None and not self.admin_token:
            raise ValueError("admin_token must not be empty (use None for no token)")

    def session_id(self, task: Instance) -> str:
        return f"{self.run_id}:{task.instance_id}"

    def to_dict(self) -> dict:
        return {**asdict(self), "admin_token": "<set>" if self.admin_token else None}


@dataclass(frozen=True)
class InstanceResult:
    """One instance of a rollout: what the agent did, how it was graded, whether the reward was stored."""

    instance_id: str
    session_id: str
    exit_reason: str  # an ExitReason, or "crashed" when the workspace or the agent raised
    turns: int
    format_errors: int
    resolved: bool
    reward: float | None  # None: not graded, or not a verdict on the policy (see the module docstring)
    reward_stored: bool  # the manager accepted the annotation
    patch_applied: bool
    fail_to_pass: tuple[int, int]  # (passed, total)
    pass_to_pass: tuple[int, int]
    error: str | None
    episode_s: float
    grade_s: float
    patch: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Played:
    """One episode of a task, graded: what a rollout and a training run both need of it."""

    episode: Episode | None  # None: the workspace or the agent raised
    evaluation: Evaluation | None  # None: not graded (no episode, or the grader raised)
    reward: float | None  # 1 resolved, 0 not; None: no verdict on the policy (see the module docstring)
    exit_reason: str  # an ExitReason, or "crashed" when the workspace or the agent raised
    error: str | None
    grade_s: float
    sandbox_wait_s: float = 0.0  # blocked on sandboxes' start-up (a pool's episodes; 0 where not measured)
    agent_wait_s: float = 0.0  # the part of it inside the agent's commands (in `episode.commands_s`)
    sandbox_spans: tuple[tuple[str, str, float, float], ...] = ()  # (lane, kind, start, end): pool.Span


def play(
    task: Instance, agent: Agent, manager_url: str, session_id: str, grader: Grader, workspace: Workspace
) -> Played:
    """One episode of `task` in session `session_id`, graded. Never raises for a failure of this episode: one
    broken task or sandbox must not end a rollout of hundreds; the result says what went wrong."""
    try:
        with workspace(task) as runner:
            episode = agent.run(task, runner, manager_url, session_id)
    except Exception as e:  # noqa: BLE001 - see the docstring
        return Played(None, None, None, "crashed", f"workspace or agent failed: {type(e).__name__}: {e}", 0.0)
    start = time.monotonic()
    try:
        evaluation = grader(task, episode.patch)
    except Exception as e:  # noqa: BLE001 - a grader failure is no verdict on the policy
        error = f"grading failed: {type(e).__name__}: {e}"
        return Played(episode, None, None, str(episode.exit_reason), error, time.monotonic() - start)
    grade_s = time.monotonic() - start
    if episode.exit_reason == ExitReason.API_ERROR:
        error = f"no reward stored: the episode ended on an API error ({episode.error})"
        return Played(episode, evaluation, None, str(episode.exit_reason), error, grade_s)
    reward = 1.0 if evaluation.resolved else 0.0
    return Played(episode, evaluation, reward, str(episode.exit_reason), episode.error, grade_s)


def run_instance(
    task: Instance, agent: Agent, config: SweRolloutConfig, grader: Grader, workspace: Workspace
) -> InstanceResult:
    """One episode of `task`, graded and annotated. Never raises for a failure of this instance (see `play`)."""
    sid = config.session_id(task)
    played = play(task, agent, config.manager_url, sid, grader, workspace)
    episode, evaluation = played.episode, played.evaluation
    if evaluation is None:
        return _failed(task, sid, played.exit_reason, played.error, episode)
    stored, error = False, played.error
    if played.reward is not None:
        problem = annotate(config, sid, _annotation(task, episode, evaluation, played.reward, config))
        stored, error = problem is None, problem or error
    g = evaluation.grade
    return InstanceResult(
        task.instance_id,
        sid,
        played.exit_reason,
        episode.turns,
        episode.format_errors,
        evaluation.resolved,
        played.reward,
        stored,
        evaluation.applied,
        g.fail_to_pass,
        g.pass_to_pass,
        error,
        episode.total_s,
        played.grade_s,
        episode.patch,
    )


def _failed(task: Instance, sid: str, reason: str, error: str, episode: Episode | None = None) -> InstanceResult:
    turns, errors = (episode.turns, episode.format_errors) if episode else (0, 0)
    return InstanceResult(
        task.instance_id,
        sid,
        reason,
        turns,
        errors,
        False,
        None,
        False,
        False,
        (0, len(task.FAIL_TO_PASS)),
        (0, len(task.PASS_TO_PASS)),
        error,
        episode.total_s if episode else 0.0,
        0.0,
        episode.patch if episode else "",
    )


def _annotation(
    task: Instance, episode: Episode, evaluation: Evaluation, reward: float, config: SweRolloutConfig
) -> dict:
    meta = {
        "run_id": config.run_id,
        "resolved": evaluation.resolved,
        "exit_reason": str(episode.exit_reason),
        "turns": episode.turns,
        "format_errors": episode.format_errors,
        "patch_applied": evaluation.applied,
        "fail_to_pass": list(evaluation.grade.fail_to_pass),
        "pass_to_pass": list(evaluation.grade.pass_to_pass),
    }
    return {"reward": reward, "task_id": task.instance_id, "meta": meta, "author": config.author}


def annotate(config: SweRolloutConfig, session_id: str, body: dict) -> str | None:
    """POST the annotation to the manager; None when stored, else why not (a result: the rollout goes on).
    Connection failures and 5xx answers are retried a few times; a 4xx is final (a 404: no finished
    request in the session, so nothing to reward)."""
    request = urllib.request.Request(
        f"{config.manager_url}/trajectories/{session_id}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"}
        | ({"Authorization": f"Bearer {config.admin_token}"} if config.admin_token else {}),
    )
    problem = "not tried"
    for attempt in range(ANNOTATION_RETRIES):
        try:
            with urllib.request.urlopen(request, timeout=config.http_timeout_s):
                return None
        except urllib.error.HTTPError as e:
            problem = f"the manager refused the reward (HTTP {e.code}): {_error_message(e)}"
            if e.code < 500:
                return problem
        except (urllib.error.URLError, OSError) as e:
            problem = f"could not reach the manager to store the reward: {e}"
        if attempt + 1 < ANNOTATION_RETRIES:
            time.sleep(0.5 * 2**attempt)
    return problem


def _error_message(e: urllib.error.HTTPError) -> str:
    try:
        return json.loads(e.read())["error"]["message"][:300]
    except (ValueError, KeyError, TypeError, OSError):
        return e.reason


def run_rollout(
    tasks: Sequence[Instance],
    agent: Agent,
    config: SweRolloutConfig,
    grader: Grader = evaluate_locally,
    workspace: Workspace = local_workspace,
    on_result: Callable[[InstanceResult], None] | None = None,
    progress: bool = False,
) -> list[InstanceResult]:
    """Every task's `InstanceResult`, in the order of `tasks`; `on_result` sees each as it finishes. Instance
    ids must be distinct: they name the sessions (`SweRolloutConfig.session_id`)."""
    repeated = sorted(i for i, n in Counter(t.instance_id for t in tasks).items() if n > 1)
    if repeated:
        raise ValueError(f"instance {repeated[0]!r} is given more than once; a rollout runs each task once")
    results: dict[str, InstanceResult] = {}
    bar = tqdm(total=len(tasks), desc="rollout", unit="task", disable=not show_progress(progress), leave=False)
    pool = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="episode")
    try:
        futures = [pool.submit(run_instance, t, agent, config, grader, workspace) for t in tasks]
        for future in as_completed(futures):
            result = future.result()
            results[result.instance_id] = result
            if on_result is not None:
                on_result(result)
            bar.set_postfix(resolved=sum(r.resolved for r in results.values()))
            bar.update(1)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # on Ctrl-C: no new episode; running ones finish
        bar.close()
    return [results[t.instance_id] for t in tasks]


def summary(results: Sequence[InstanceResult]) -> dict:
    resolved = sum(r.resolved for r in results)
    return {
        "instances": len(results),
        "resolved": resolved,
        "pass@1": resolved / len(results) if results else 0.0,
        "rewards_stored": sum(r.reward_stored for r in results),
        "exit_reasons": dict(Counter(r.exit_reason for r in results)),
        "mean_turns": sum(r.turns for r in results) / len(results) if results else 0.0,
    }


def format_table(results: Sequence[InstanceResult]) -> str:
    """One line an instance, then pass@1."""
    width = max([len("instance"), *(len(r.instance_id) for r in results)])
    lines = [f"{'instance':<{width}}  {'exit':<13} turns  F2P    P2P      resolved  reward  time_s"]
    for r in results:
        f2p, p2p = "{}/{}".format(*r.fail_to_pass), "{}/{}".format(*r.pass_to_pass)
        reward = "-" if r.reward is None else f"{r.reward:g}" + ("" if r.reward_stored else "!")
        lines.append(
            f"{r.instance_id:<{width}}  {r.exit_reason:<13} {r.turns:>5}  {f2p:<6} {p2p:<8} "
            f"{'yes' if r.resolved else 'no':<9} {reward:<7} {r.episode_s + r.grade_s:>6.1f}"
        )
    s = summary(results)
    lines.append(
        f"pass@1: {s['resolved']}/{s['instances']} = {s['pass@1']:.1%}  (rewards stored: "
        f"{s['rewards_stored']}; '!' = not stored, '-' = no reward)"
    )
    return "\n".join(lines)


def rollout_to(
    out: Path,
    tasks: Sequence[Instance],
    agent: Agent,
    config: SweRolloutConfig,
    settings: dict,
    grader: Grader = evaluate_locally,
    workspace: Workspace = local_workspace,
) -> list[InstanceResult]:
    """`run_rollout` writing DIR/config.json (`settings` + the rollout config), results.jsonl as results
    come in, and summary.json; prints the table."""
    (out / "config.json").write_text(json.dumps({**settings, "rollout": config.to_dict()}, indent=2) + "\n")
    with (out / "results.jsonl").open("a", encoding="utf-8") as lines:

        def write(result: InstanceResult) -> None:
            lines.write(json.dumps(result.to_dict(), ensure_ascii=False) + "\n")
            lines.flush()

        results = run_rollout(tasks, agent, config, grader, workspace, on_result=write, progress=True)
    (out / "summary.json").write_text(json.dumps(summary(results), indent=2) + "\n")
    print(format_table(results))
    print(f"results in {out}/ (sessions {config.run_id}:<instance_id>)", file=sys.stderr)
    return results


# ---- the command line (`python -m swebench_env rollout`; the parser is in cli.py) ----


def read_admin_token(path: Path | None) -> str | None:
    """The manager's admin token: from `path` (--admin-token-file), else $SEAMLESSFLOW_ADMIN_TOKEN, else None.
    Never from the command line, which every local user can read."""
    from reference.engine.auth import MANAGER_TOKEN_ENV as ADMIN_TOKEN_ENV

    if path is None:
        return os.environ.get(ADMIN_TOKEN_ENV) or None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --admin-token-file {path}: {e}") from None
    if not token:
        raise ValueError(f"--admin-token-file {path} is empty")
    return token


def check_manager(config: SweRolloutConfig) -> None:
    """ValueError unless the manager at `config.manager_url` answers its health check: better than every
    episode retrying against nothing."""
    try:
        with urllib.request.urlopen(f"{config.manager_url}/health", timeout=config.http_timeout_s):
            return
    except urllib.error.HTTPError as e:
        body = e.read()[:300].decode(errors="replace")
        raise ValueError(f"the manager at {config.manager_url} is not healthy (HTTP {e.code}): {body}") from None
    except (urllib.error.URLError, OSError) as e:
        raise ValueError(f"no trajectory manager answers at {config.manager_url}: {e}") from None


def rollout_command(args, tasks: Sequence[Instance]) -> int:
    """`python -m swebench_env rollout`: every task once, against the manager at --base-url."""
    agent_config = AgentConfig(
        max_turns=args.max_turns,
        command_timeout_s=args.command_timeout_s,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        model=args.model,
    )
    if args.mini_config is not None and args.agent != "mini-swe-agent":
        raise UserError(f"--mini-config is for --agent mini-swe-agent, not --agent {args.agent}")
    if args.mini_config is not None:
        agent = _mini_swe_agent(agent_config, args.mini_config)
    else:
        agent = make_agent(args.agent, agent_config)
    config = SweRolloutConfig(
        args.base_url, args.concurrency, args.run_id or "", read_admin_token(args.admin_token_file)
    )
    check_manager(config)
    out = prepare_out(args.out, args.out, args.overwrite)
    settings = {
        "command": "rollout",
        "tasks": str(args.tasks),
        "instances": len(tasks),
        "agent": args.agent,
        "sandbox": args.sandbox,
        "agent_config": asdict(agent_config),
    }
    if args.mini_config is not None:
        settings["mini_config"] = str(args.mini_config)
    if args.sandbox != "docker":
        workspace, grader = environment(args.sandbox, args.image)
        rollout_to(out, tasks, agent, config, settings, grader, workspace)
        return 0
    from swebench_env.pool import SandboxPool

    with SandboxPool(config.concurrency, spares=CLI_SPARES) as pool:  # containers started ahead of the episodes
        workspace, grader = pooled_environment(pool, args.image)
        rollout_to(out, tasks, agent, config, settings, grader, workspace)
    return 0
