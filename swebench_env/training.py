"""SWE tasks as a training task: how `swebench_env` plugs into the runtime's group rollout (the episode seam).

`SweTask` is registered in `reference.tasks.TASKS` as `swe`. A problem is one SWE task (its instance id);
an episode is one agent run on it: a fresh workspace (a Docker sandbox with the checkout at /testbed, or
a local checkout), the agent (`builtin` or the unmodified `mini-swe-agent`) talking to the trajectory
manager in a session of its own (`<key>-e<i>`), then the patch graded in a fresh sandbox (`rollout.play`,
the same code as `python -m swebench_env rollout`). Reward 1 when the task is resolved, else 0; an
episode whose workspace, agent or grader failed, or that ended on an API error, has no verdict
(`reward=None`) and is left out of its group (a sandbox killed mid-episode fails that episode alone).
An episode cut off by the turn limit or the context is graded on the diff it left, like any other, and its
reward counts in its group's baseline; with `overlong: mask` (the default) none of its tokens is trained
(overlong filtering, as in DAPO): a wandering episode's hundreds of off-path tokens would otherwise dominate
the step's gradient (see `reference/trainer/recipe.py`'s SWE notes). Its exit reason is kept with the
group's record.

Episodes run in threads of the task's own pool (`concurrency` of them: agents and sandboxes block), never
in the event loop's default executor, which the manager needs for its store. The requests that make an
episode are read back from the manager (`GET /trajectories/<session>`), so the agent needs no hook.

Docker sandboxes come from a `pool.SandboxPool` of `concurrency` slots that keeps `spare_sandboxes` of each kind
(workspace, grader) started ahead, so an episode seldom waits for a container to start; each episode's
`info` says how long it did wait (`sandbox_wait_s`) and what its sandboxes did (`SANDBOX_SPANS`: the sandbox
lanes of the run's timeline). The task reaps the containers of killed runs when it starts.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from core.errors import UserError, unknown_name
from reference.rollout.episodes import SANDBOX_SPANS, Episode, EpisodeContext, episode_records
from reference.tasks.base import Problem
from reference.tokenizer import Tokenizer, default_tokenizer
from reference.trainer.batch import Trajectory
from swebench_env.agent import AgentConfig
from swebench_env.rollout import AGENTS, SANDBOXES, Played, environment, make_agent, play
from swebench_env.sandbox import SandboxError
from swebench_env.tasks import Instance, load_tasks

log = logging.getLogger(__name__)
SPLITS = ("train", "held_out")
OVERLONG = ("mask", "train")
CUT_OFF = ("turn_limit", "context_limit")  # exit reasons of an episode the agent did not end itself


@dataclass(frozen=True)
class SweTaskConfig:
    train_tasks: str = ""  # a task file (JSON or JSONL); "": the shipped suite's train split
    held_out_tasks: str = ""  # a task file; "": the shipped suite's held-out split
    agent: str = "builtin"  # a name in swebench_env.rollout.AGENTS
    sandbox: str = "docker"  # docker, or local (no isolation: trusted tasks only)
    image: str | None = None  # the Docker image for local-repository tasks; None: the offline base image
    max_turns: int = 12  # model calls an episode
    max_tokens: int = 512  # tokens a model call may generate (the longest demonstration step is 391)
    command_timeout_s: float = 30.0  # each bash command
    test_timeout_s: float = 120.0  # the grader's test run (past it: timed out, reward 0)
    max_observation_chars: int = 2000  # command output shown to the model (head and tail kept)
    concurrency: int = 4  # episodes (and their sandboxes) in flight at once
    spare_sandboxes: int = 2  # docker: containers of each kind (workspace, grader) started ahead; 0: none
    context_tokens: int = 4096  # the model's context: an episode that outgrows it ends as context_limit
    tokenizer: str | None = None  # a tokenizer directory; None: the project's default
    overlong: str = "mask"  # an episode cut off (turn limit, context limit): mask (not trained) or train

    def __post_init__(self) -> None:
        if self.agent not in AGENTS:
            raise unknown_name("agent", self.agent, AGENTS)
        if self.sandbox not in SANDBOXES:
            raise unknown_name("sandbox", self.sandbox, SANDBOXES)
        if self.overlong not in OVERLONG:
            raise unknown_name("overlong", self.overlong, OVERLONG)
        for name in ("max_turns", "max_tokens", "max_observation_chars", "concurrency", "context_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UserError(f"task.{name} must be an integer >= 1, got {value!r}")
        spares = self.spare_sandboxes
        if not isinstance(spares, int) or isinstance(spares, bool) or spares < 0:
            raise UserError(f"task.spare_sandboxes must be an integer >= 0, got {self.spare_sandboxes!r}")
        for name in ("command_timeout_s", "test_timeout_s"):
            if not (isinstance(getattr(self, name), int | float) and getattr(self, name) > 0):
                raise UserError(f"task.{name} must be a number > 0, got {getattr(self, name)!r}")


class SweTask:
    name = "swe"

    def __init__(self, config: SweTaskConfig | None = None, **overrides) -> None:
        self.config = c = config or SweTaskConfig(**overrides)
        self._tokenizer = Tokenizer.load(c.tokenizer) if c.tokenizer else default_tokenizer()
        if c.sandbox == "docker":
            _reap_killed_runs()
        self.instances = {s: _load(s, getattr(c, f"{s}_tasks")) for s in SPLITS}
        self._by_id = {t.instance_id: t for split in self.instances.values() for t in split}
        self._pool: ThreadPoolExecutor | None = None
        self._order: list = []  # what is left of the current pass over the train split (`sample_train`)
        self._sandboxes = None  # the docker sandbox pool, made on first use
        self._lock = threading.Lock()
        self._environment = None
        self._closed = False

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def sandbox_pool(self):
        """The docker sandbox pool (`pool.SandboxPool`) once an episode has used it, else None."""
        return self._sandboxes

    @property
    def max_tokens(self) -> int:
        return self.config.max_tokens

    @property
    def context_tokens(self) -> int:
        """Positions a fresh model needs (`reference.control.layout.task_context`)."""
        return self.config.context_tokens

    def simulator_workload(self) -> dict:
        """The simulator's `workload` keys for this task's episodes, measured (`swebench_env/sim_workload.py`)."""
        from swebench_env.suite_workload import task_workload

        return task_workload(self.config)

    def sample_train(self, rng: random.Random, n: int) -> list[Problem]:
        """The next `n` train tasks in passes over the split, each pass in an order shuffled by `rng`: every task
        is visited once before any twice (drawn with replacement, 8 tasks a step over 32 visited some 4-5 times in
        8 steps and others never, and what RL gains on a task it gains on the visits it gets)."""
        out = []
        while len(out) < n:
            if not self._order:
                self._order = list(self.instances["train"])
                rng.shuffle(self._order)
            out.append(_problem(self._order.pop()))
        return out

    def held_out(self) -> list[Problem]:
        return [_problem(t) for t in self.instances["held_out"]]

    def train_problems(self) -> list[Problem]:
        """Every training task once (pass@1 on the train split)."""
        return [_problem(t) for t in self.instances["train"]]

    async def episodes(self, problem: Problem, n: int, key: str, ctx: EpisodeContext) -> list[Episode]:
        instance = self._by_id[problem.problem_id]
        config = self._agent_config(ctx.temperature)
        if ctx.fixed_seed is None:  # the engines draw each call's seed
            agents = [make_agent(self.config.agent, config)] * n
        else:  # an evaluation: each episode's seed fixed (common random numbers across evaluations)
            seeds = [ctx.episode_seed(problem.problem_id, i) for i in range(n)]
            agents = [make_agent(self.config.agent, replace(config, seed=seed)) for seed in seeds]
        loop = asyncio.get_running_loop()
        sessions = [f"{key}-e{i}" for i in range(n)]
        runs = [
            loop.run_in_executor(self._threads(), self._play, instance, agent, sid, ctx.base_url)
            for sid, agent in zip(sessions, agents, strict=True)
        ]
        played = await asyncio.gather(*runs)
        return [await self._episode(sid, p, ctx) for sid, p in zip(sessions, played, strict=True)]

    def demonstrations(self, workdir: Path) -> list[Trajectory]:
        """The train split's demonstrations as training records for a supervised warm start: each replayed by
        this task's agent through a trajectory manager whose engine plays it (`scripted`), its commands run in
        this task's workspaces and its patch graded, so the records hold exactly what a rollout would (the
        agent's prompts, the observations it saw) and the demonstration's replies as generated tokens. The
        store is kept in `workdir`. A demonstration that does not resolve its task, or that outgrows the
        model's context, is left out with one `warning:` line."""
        from reference.manager.manager import ManagerConfig
        from swebench_env.scripted import demonstration_manager
        from swebench_env.suite import load_suite_demonstrations

        workdir.mkdir(parents=True, exist_ok=True)
        demos = {d.instance_id: d for d in load_suite_demonstrations("all")}
        pairs = [(t, demos[t.instance_id]) for t in self.instances["train"] if t.instance_id in demos]
        if not pairs:
            raise UserError("no demonstration for any training task: a warm start needs some")
        longest = max(len(d.steps) for _, d in pairs)
        agent = make_agent(self.config.agent, replace(self._agent_config(0.0), max_turns=longest + 1))
        submit_tool = self.config.agent == "builtin"
        # As the run's own manager: the task bounds the episodes in flight, so the manager sheds nothing (its
        # default sheds with 429 while its event loop lags, as it does when 32 agents start at once).
        config = ManagerConfig(max_in_flight_requests=0, max_loop_lag_s=0)
        with demonstration_manager(
            pairs, self._tokenizer, workdir / "demonstrations.sqlite", config, submit_tool=submit_tool
        ) as m:
            futures = [self._threads().submit(self._play, t, agent, f"demo-{t.instance_id}", m.url) for t, _ in pairs]
            played = [f.result() for f in futures]
            return self._demonstration_records(m.store, pairs, played)

    def _demonstration_records(self, store, pairs, played: list[Played]) -> list[Trajectory]:
        out = []
        for (instance, _), p in zip(pairs, played, strict=True):
            sid = f"demo-{instance.instance_id}"
            if p.reward != 1.0 or not store.has_session(sid):
                print(
                    f"warning: the demonstration of {instance.instance_id} did not resolve it ({p.exit_reason}"
                    f"{': ' + p.error if p.error else ''}); left out of the warm start",
                    file=sys.stderr,
                )
                continue
            rids = tuple(r.request_id for r in store.records(sid))
            (records,) = episode_records(store, [Episode(sid, rids, 0.0, True, 0, 0, 0)])
            for record in records:
                if len(record["token_ids"]) > self.config.context_tokens:
                    print(
                        f"warning: the demonstration of {instance.instance_id} holds {len(record['token_ids'])} "
                        f"tokens, more than the model's context ({self.config.context_tokens}); left out",
                        file=sys.stderr,
                    )
                    break
            else:
                out += [Trajectory.from_export(r, group_id=instance.instance_id, episode_id=0) for r in records]
        return out

    def close(self) -> None:
        """Stop: no new episode starts, the running ones' sandboxes are removed (their commands fail, and with the
        manager gone their model calls too, so they end within seconds), and their threads are joined; the spare
        sandboxes are removed."""
        self._closed = True
        with self._lock:
            sandboxes, self._sandboxes = self._sandboxes, None
        if sandboxes is not None:
            sandboxes.close(wait=False)  # no new container from here on
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            if self.config.sandbox == "docker":
                from swebench_env.sandbox import close_open_sandboxes

                close_open_sandboxes()
            self._pool.shutdown(wait=True)
            self._pool = None
        if sandboxes is not None:
            sandboxes.close()

    # ---- one episode ----

    def _agent_config(self, temperature: float) -> AgentConfig:
        c = self.config
        # Few, quick retries: the run's manager sheds no load, so a failing call means it is gone (a stopped run).
        return AgentConfig(
            max_turns=c.max_turns,
            command_timeout_s=c.command_timeout_s,
            max_tokens=c.max_tokens,
            max_observation_chars=c.max_observation_chars,
            temperature=temperature,
            max_retries=2,
            retry_base_s=0.5,
            retry_max_s=2.0,
        )

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.config.concurrency, thread_name_prefix="swe-episode")
        return self._pool

    def _play(self, instance: Instance, agent, session_id: str, manager_url: str) -> Played:
        if self._closed:
            return Played(None, None, None, "crashed", "the run stopped before this episode began", 0.0)
        c = self.config
        if c.sandbox != "docker":
            if self._environment is None:
                self._environment = environment(c.sandbox, c.image, c.test_timeout_s)
            workspace, grader = self._environment
            return play(instance, agent, manager_url, session_id, grader, workspace)
        try:
            sandboxes = self._sandbox_pool().episode(c.image, c.test_timeout_s)
        except SandboxError as e:  # the pool has closed: the run is stopping
            return Played(None, None, None, "crashed", str(e), 0.0)
        played = play(instance, agent, manager_url, session_id, sandboxes.grader, sandboxes.workspace)
        return replace(
            played,
            sandbox_wait_s=sandboxes.wait_s,
            agent_wait_s=sandboxes.agent_wait_s,
            sandbox_spans=tuple(s.as_tuple() for s in sandboxes.spans),
        )

    def _sandbox_pool(self):
        from swebench_env.pool import SandboxPool

        with self._lock:
            if self._closed:
                raise SandboxError("the run stopped before this episode began")
            if self._sandboxes is None:
                self._sandboxes = SandboxPool(self.config.concurrency, self.config.spare_sandboxes)
            return self._sandboxes

    async def _episode(self, session_id: str, played: Played, ctx: EpisodeContext) -> Episode:
        """The seam's record of a played episode: its requests and their versions, read from the manager."""
        request_ids, versions = await _requests(ctx, session_id)
        reward = played.reward if request_ids else None  # no request reached the model: nothing to train
        run = played.episode
        # The agent's first command may wait for its workspace to start: sandbox_wait_s, not tool_latency_s.
        commands_s = max(0.0, run.commands_s - played.agent_wait_s) if run else 0.0
        info = {
            "turns": run.turns if run else 0,
            "format_errors": run.format_errors if run else 0,
            "error": played.error,
            "patch_chars": len(run.patch) if run else 0,
            "model_s": run.model_s if run else 0.0,
            "tool_latency_s": commands_s,
            "test_run_s": played.grade_s,
            "episode_s": (run.total_s if run else 0.0) + played.grade_s,
            "sandbox_wait_s": played.sandbox_wait_s,
            SANDBOX_SPANS: list(played.sandbox_spans),
        }
        resolved = played.evaluation is not None and played.evaluation.resolved
        trained = not (self.config.overlong == "mask" and played.exit_reason in CUT_OFF)
        return Episode(
            session_id,
            request_ids,
            reward,
            resolved,
            min(versions, default=0),
            max(versions, default=0),
            len(versions),
            played.exit_reason,
            trained,
            info,
        )


async def _requests(ctx: EpisodeContext, session_id: str) -> tuple[tuple[str, ...], list[int]]:
    """(the session's request ids, the versions of its generated tokens); empty for a session never opened."""
    tree = await ctx.get(f"/trajectories/{session_id}")
    if tree is None:
        return (), []
    request_ids: list[str] = []
    seen: set[tuple[int, int]] = set()  # (position, token) of generated tokens: branches share their prefix
    versions: list[int] = []
    for branch in tree["branches"]:
        request_ids += [r for r in branch["request_ids"] if r not in request_ids]
        for i, (token, g, v) in enumerate(
            zip(branch["token_ids"], branch["generated_mask"], branch["versions"], strict=True)
        ):
            if g and (i, token) not in seen:
                seen.add((i, token))
                versions.append(v)
    return tuple(request_ids), versions


def _reap_killed_runs() -> None:
    """Check the daemon (no daemon: one line saying how to start one, before anything runs), and remove the sandbox
    containers that runs killed outright left (their owner process is gone: `reaper.py`)."""
    from swebench_env.docker_util import DockerUnavailable, docker_client
    from swebench_env.reaper import reap_stale_sandboxes

    try:
        client = docker_client()
    except DockerUnavailable as e:
        raise UserError(str(e)) from None
    try:
        removed = reap_stale_sandboxes(client)
    except Exception as e:  # noqa: BLE001 - never stop a run over another run's leftovers
        log.warning("could not reap the sandboxes of killed runs: %s", e)
        return
    if removed:
        print(f"removed {len(removed)} sandbox container(s) left by killed runs", file=sys.stderr)


def _problem(instance: Instance) -> Problem:
    """A problem names its task; the statement stays in the task file (a group's record holds the problem)."""
    return Problem(instance.instance_id, "", "")


def _load(split: str, path: str) -> list[Instance]:
    """The tasks of a split; a broken record in a task file is skipped with one `warning:` line on stderr."""
    if path:
        problems: list[str] = []
        try:
            tasks = load_tasks(Path(path), problems=problems)
        except (OSError, ValueError) as e:
            raise UserError(str(e)) from None
        for line in problems:
            print(f"warning: {line} (skipped)", file=sys.stderr)
    else:
        from swebench_env.suite import load_suite

        tasks = load_suite(split)
    if not tasks:
        raise UserError(f"no usable task in the {split} tasks {path or '(the shipped suite)'}")
    return tasks
