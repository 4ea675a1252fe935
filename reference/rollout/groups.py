"""The rollout manager: GRPO groups of episodes through the trajectory manager, rewarded, streamed out.

A group is one problem run `group_size` times: the task makes the episodes (`Task.episodes`, the seam in
`episodes.py`: one `/completions` request with `n` choices for a single-turn task, an agent in a sandbox
per episode for a SWE task) and says what each earned. The group's record is then written with each of
its episodes' sessions (`POST /trajectories/<sid>`: the problem, the group's key and revision, its
episodes, and each request's reward in `meta.request_rewards`) before the group counts as finished; it
is then announced once (`on_group`) with the oldest policy version among its tokens. An episode with no
verdict (`reward=None`) is left out of its group; a group with none left is run again (`retries` times).

The trainer reads exactly the tokens the engines consumed and produced, with their logprobs and
versions, from the manager's durable store (`training_batch`, by `episodes.episode_records`' rule: every
generated token once, each episode counted once in its group).

`refresh` runs again the episodes of finished groups that hold tokens older than a version (fresh
episodes of the same problem, in new sessions); the group finishes anew. Concurrency is bounded by
`max_concurrency` samples in flight (whole groups). Everything runs on one asyncio loop; `on_group` is
called on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from reference.manager.store import TrajectoryStore
from reference.rollout.episodes import TIMING_KEYS, Episode, EpisodeContext, RolloutError, episode_records
from reference.tasks.base import Problem, Task
from reference.trainer.batch import Trajectory

log = logging.getLogger(__name__)

__all__ = [
    "Episode",
    "GroupResult",
    "RolloutConfig",
    "RolloutError",
    "RolloutManager",
    "newest_group_records",
    "stored_groups",
    "training_batch",
    "untrained_groups",
]


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 16  # episodes per problem (GRPO's n)
    max_concurrency: int = 64  # samples in flight at once (whole groups)
    temperature: float = 1.0
    request_timeout_s: float = 600.0  # one completion, waits included (pauses for weight syncs, preemptions)
    retries: int = 3  # a failed request (5xx, connection) or a group with no verdict is retried this often

    def __post_init__(self) -> None:
        for name in ("group_size", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"rollout.temperature must be in [0, 2], got {self.temperature}")
        if not self.request_timeout_s > 0 or self.retries < 0:
            raise ValueError("rollout.request_timeout_s must be > 0 and rollout.retries >= 0")


@dataclass(frozen=True)
class GroupResult:
    group_id: int
    key: str  # unique across runs of one store: its episodes' sessions start with it; also its consumed-marker
    problem: Problem
    episodes: tuple[Episode, ...]  # the rewarded ones

    @property
    def min_version(self) -> int:
        return min(e.min_version for e in self.episodes)

    @property
    def mean_reward(self) -> float:
        return sum(e.reward for e in self.episodes) / len(self.episodes)


class RolloutManager:
    def __init__(
        self,
        task: Task,
        base_url: str,
        config: RolloutConfig,
        run_id: str,
        seed: int,
        on_group: Callable[[GroupResult], None],
        admin_token: str | None = None,
    ) -> None:
        self.task, self.base_url, self.config, self.run_id = task, base_url.rstrip("/"), config, run_id
        self.on_group = on_group
        self._rng = random.Random(seed)
        self._eval_seed = seed  # every evaluation's episodes draw from seeds fixed by it (`evaluate`)
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http: aiohttp.ClientSession | None = None
        self._ctx: EpisodeContext | None = None
        self._slots: asyncio.Semaphore | None = None
        self._next_group = 0
        self.groups: dict[int, GroupResult] = {}  # finished (and not yet refreshed) groups
        self._problems: dict[int, Problem] = {}
        self._keys: dict[int, str] = {}  # group id -> its key (and consumed-marker)
        self._revisions: dict[int, int] = defaultdict(int)  # group id -> episode runs started for it
        self._adopted: deque[GroupResult] = deque()
        self._tasks: set[asyncio.Task] = set()
        self.failure: BaseException | None = None
        self.requests = 0  # episode runs (one per group, or per refresh or retry of a group)
        self.refreshed = 0  # episodes of finished groups run again (`refresh`: too old to train on)
        self.dropped = 0  # episodes with no verdict, left out of their group

    async def __aenter__(self) -> RolloutManager:
        limit = self.config.max_concurrency
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit + 8))
        c = self.config
        self._ctx = EpisodeContext(
            self.base_url, self._http, self._headers, c.temperature, c.request_timeout_s, c.retries, self._rng
        )
        self._slots = asyncio.Semaphore(max(1, limit // self.config.group_size))  # a run holds a group
        return self

    async def __aexit__(self, *exc) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    # ---- what the control plane asks ----

    def submit(self, num_groups: int, problems: Sequence[Problem] | None = None) -> list[int]:
        """Start `num_groups` groups: adopted ones first (they finish at once), then fresh training problems
        (`problems`, when given, instead of drawing them from the task)."""
        ids = []
        while self._adopted and len(ids) < num_groups:
            ids.append(self._adopt(self._adopted.popleft()))
        if problems is not None and len(problems) != num_groups - len(ids):
            raise ValueError(f"{len(problems)} problems given for {num_groups - len(ids)} fresh groups")
        fresh = self.task.sample_train(self._rng, num_groups - len(ids)) if problems is None else problems
        for problem in fresh:
            gid, self._next_group = self._next_group, self._next_group + 1
            self._problems[gid], self._keys[gid] = problem, f"{self.run_id}-g{gid}"
            self._spawn(self._run_group(gid, self.config.group_size, ()))
            ids.append(gid)
        return ids

    def adopt(self, groups: Sequence[GroupResult]) -> None:
        """Finished groups of an earlier run that training has not used (a resumed run's released groups):
        `submit` hands them out before it generates anything, so no finished group is lost."""
        self._adopted.extend(groups)

    def _adopt(self, old: GroupResult) -> int:
        gid, self._next_group = self._next_group, self._next_group + 1
        group = dataclasses.replace(old, group_id=gid)
        self._problems[gid], self._keys[gid], self.groups[gid] = group.problem, group.key, group
        self._revisions[gid] = 1 + max((_revision(e.session_id, group.key) for e in group.episodes), default=0)
        asyncio.get_running_loop().call_soon(self.on_group, group)  # after the Submit that asked for it
        return gid

    def refresh(self, group_ids: Sequence[int], min_keep_version: int) -> None:
        """Run again each episode of these finished groups that holds tokens older than `min_keep_version` (and
        the ones that had no verdict: the group is made whole again)."""
        for gid in group_ids:
            old = self.groups.pop(gid)
            kept = tuple(e for e in old.episodes if e.min_version >= min_keep_version)
            self.refreshed += len(old.episodes) - len(kept)
            self._spawn(self._run_group(gid, max(1, self.config.group_size - len(kept)), kept))

    def take(self, group_ids: Sequence[int]) -> list[GroupResult]:
        """Remove finished groups for a training step."""
        return [self.groups.pop(gid) for gid in group_ids]

    async def evaluate(self, problems: Sequence[Problem], label: str, samples: int = 1) -> dict:
        """`samples` episodes of each problem (not trained on): mean reward and exact-match rate over the episodes
        with a verdict (`dropped`: those without; with a 0/1 reward the mean is pass@1 estimated from `samples`
        episodes a problem), the oldest and newest policy version they sampled with, and `instances`: each
        problem's [reward sum, episodes with a verdict].

        Each episode's sampling seed is fixed by the run's seed, its problem and its index (common random numbers:
        `EpisodeContext.with_fixed_seeds`): the evaluations of a run draw the same numbers for the same episode,
        so what differs between two of them is the weights, not the luck of the draw."""
        ctx = self._ctx.with_fixed_seeds(self._eval_seed)
        runs = await asyncio.gather(
            *(self._evaluate_one(p, samples, f"{self.run_id}-eval-{label}-{i}", ctx) for i, p in enumerate(problems))
        )
        flat = [e for episodes in runs for e in episodes]
        judged = [e for e in flat if e.rewarded]
        n = max(1, len(judged))
        instances = {}
        for problem, episodes in zip(problems, runs, strict=True):
            rewards = [e.reward for e in episodes if e.rewarded]
            instances[problem.problem_id] = [round(sum(rewards), 6), len(rewards)]
        return {
            "reward_mean": sum(e.reward for e in judged) / n,
            "exact_match": sum(e.exact for e in judged) / n,
            "problems": len(problems),
            "samples": samples,
            "dropped": len(flat) - len(judged),
            "versions": [min((e.min_version for e in flat), default=0), max((e.max_version for e in flat), default=0)],
            "instances": instances,
        }

    async def _evaluate_one(self, problem: Problem, samples: int, key: str, ctx: EpisodeContext) -> list[Episode]:
        async with self._slots:
            return list(await self.task.episodes(problem, samples, key, ctx))

    def key(self, group_id: int) -> str:
        return self._keys[group_id]

    # ---- generation ----

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()
            log.error("rollout failed: %s", self.failure)

    async def _run_group(self, gid: int, n: int, kept: tuple[Episode, ...]) -> None:
        """Run `n` episodes of the group's problem (again, while none has a verdict), write the group's record
        with its episodes' sessions; then the group (with the episodes `kept` from before) is finished."""
        problem, key = self._problems[gid], self.key(gid)
        episodes: tuple[Episode, ...] = ()
        for _ in range(self.config.retries + 1):
            episodes = await self._episodes(gid, problem, n)
            if kept or episodes:
                break
            log.warning("group %s: no episode of %d had a verdict; running it again", key, n)
        else:
            raise RolloutError(f"group {key}: no episode had a verdict in {self.config.retries + 1} runs")
        group = GroupResult(gid, key, problem, kept + episodes)
        await self._write_record(group)
        self.groups[gid] = group
        self.on_group(group)

    async def _episodes(self, gid: int, problem: Problem, n: int) -> tuple[Episode, ...]:
        """`n` fresh episodes of `problem` under the group's next key (`<key>` first, then `<key>.<revision>`);
        only those with a verdict."""
        revision = self._revisions[gid]
        self._revisions[gid] += 1
        key = self.key(gid) if revision == 0 else f"{self.key(gid)}.{revision}"
        async with self._slots:
            episodes = await self.task.episodes(problem, n, key, self._ctx)
        self.requests += 1
        if len(episodes) != n:
            raise RolloutError(f"task {self.task.name!r} returned {len(episodes)} episodes for {n} asked")
        judged = tuple(e for e in episodes if e.rewarded)
        self.dropped += n - len(judged)
        return judged

    async def _write_record(self, group: GroupResult) -> None:
        """The group's record, with each session that holds its episodes (the newest record of a group wins:
        `stored_groups`). `request_rewards`: every request's reward, which `training_batch` trains with."""
        sessions: dict[str, list[Episode]] = defaultdict(list)
        for e in group.episodes:
            sessions[e.session_id].append(e)
        meta = {
            "group": group.key,
            "revision": self._revisions[group.group_id],
            "problem": dataclasses.asdict(group.problem),
            "episodes": [e.to_meta() for e in group.episodes],
        }
        for sid, episodes in sessions.items():
            rewards = {rid: e.reward for e in episodes for rid in e.request_ids}
            body = {"task_id": group.problem.problem_id, "meta": {**meta, "request_rewards": rewards}}
            if len(episodes) == 1:  # the session is one episode: its reward is the session's (for export)
                body["reward"] = episodes[0].reward
            branches = {str(e.info["branch_id"]): e.reward for e in episodes if "branch_id" in e.info}
            if branches:
                body["branch_rewards"] = branches
            await self._ctx.post(f"/trajectories/{sid}", body)


def _revision(session_id: str, key: str) -> int:
    """The revision whose run named this session (`<key>`, `<key>.<r>`, or a task's `<key>...-e<i>` below it)."""
    rest = session_id[len(key) :]
    if rest.startswith("."):
        digits = rest[1:].split("-", 1)[0].split(".", 1)[0]
        return int(digits) if digits.isdigit() else 0
    return 0


def untrained_groups(store: TrajectoryStore) -> list[GroupResult]:
    """Every finished rollout group in the store that no training step consumed, oldest first (what a
    resumed run adopts, so that no finished group is lost)."""
    return stored_groups(store, list(newest_group_records(store, skip=store.consumed()).values()))


def newest_group_records(store: TrajectoryStore, skip=()) -> dict[str, str]:
    """Group key -> a session holding that finished group's newest record (its highest revision), for every
    group in the store but those in `skip`."""
    newest: dict[str, tuple[int, str]] = {}  # group key -> (revision, session)
    for sid in store.sessions():
        meta = store.annotations(sid).get("meta", {})
        key = meta.get("group")
        if key is None or "episodes" not in meta or key in skip:
            continue
        if key not in newest or meta.get("revision", 0) > newest[key][0]:
            newest[key] = (meta.get("revision", 0), sid)
    return {key: sid for key, (_, sid) in newest.items()}


def stored_groups(store: TrajectoryStore, sessions: Sequence[str]) -> list[GroupResult]:
    """Finished groups as the rollout manager wrote them to the store, one per session named (a session that
    holds the group's newest record); group ids are assigned when they are adopted. Each episode keeps what the
    record kept of its `info`: its timings (`Episode.to_meta`), which the step that trains it reports."""
    out = []
    for sid in sessions:
        meta = store.annotations(sid).get("meta", {})
        if "problem" not in meta or "episodes" not in meta or "group" not in meta:
            raise ValueError(f"session {sid!r} holds no finished rollout group (no problem, group or episodes)")
        episodes = []
        for e in meta["episodes"]:
            timings = {k: e[k] for k in TIMING_KEYS if k in e}
            stub = Episode(
                e["session_id"],
                tuple(e["request_ids"]),
                e["reward"],
                e["exact"],
                0,
                0,
                0,
                e["exit_reason"],
                e.get("trained", True),
                timings,
            )
            low, high, tokens = _stats(store, stub)
            episodes.append(dataclasses.replace(stub, min_version=low, max_version=high, tokens=tokens))
        out.append(GroupResult(-1, meta["group"], Problem(**meta["problem"]), tuple(episodes)))
    return out


def _stats(store: TrajectoryStore, episode: Episode) -> tuple[int, int, int]:
    """(oldest version, newest version, generated tokens) of an episode's requests."""
    wanted = set(episode.request_ids)
    versions = [v for r in store.records(episode.session_id) if r.request_id in wanted for v in r.versions]
    return min(versions, default=0), max(versions, default=0), len(versions)


def training_batch(store: TrajectoryStore, groups: Sequence[GroupResult]) -> list[Trajectory]:
    """The trainer's records of these groups, read from the manager's durable store: exactly the tokens the
    engines consumed and produced, with their logprobs, versions and the episodes' rewards
    (`episodes.episode_records`: every generated token once, each episode one sample of its group; an episode
    marked not `trained` counts in its group's advantages, and its tokens are masked out of the loss)."""
    episodes = [e for g in groups for e in g.episodes]
    records = iter(episode_records(store, episodes))
    out = []
    for g in groups:
        for i in range(len(g.episodes)):
            trained = g.episodes[i].trained
            out += [Trajectory.from_export(r, group_id=g.key, episode_id=i, trained=trained) for r in next(records)]
    return out
