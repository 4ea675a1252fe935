"""The rollout manager: GRPO prompt groups through the trajectory manager, graded, rewarded, streamed out.

A group is one problem sampled `group_size` times, as one request with `n` samples in the group's own
session of the trajectory manager (`/s/<run>-g<group>/v1/completions`, the raw prompt, no chat template):
one HTTP round trip a group, not one a sample. The trainer reads exactly the tokens the engines consumed
and produced, with their logprobs and versions, from the manager's durable store, one record per request
(`reference.export.request_records`: two samples with the same tokens stay two samples). Each sample is
graded by the task and the rewards are written with the session (`POST /trajectories/<sid>`: per branch,
and per request in `meta.request_rewards`) before the group counts as finished; it is then announced once
(`on_group`) with the oldest policy version among its tokens.

`refresh` regenerates the samples of finished groups that hold tokens older than a version (fresh samples
of the same problem, in the same session); the group finishes anew. Concurrency is bounded by
`max_concurrency` samples in flight (whole groups). Everything runs on one asyncio loop; `on_group` is called on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp

from reference.export import request_records
from reference.manager.store import TrajectoryStore
from reference.tasks.base import Problem, Task
from reference.trainer.batch import Trajectory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 16  # samples per problem (GRPO's n)
    max_concurrency: int = 64  # completion requests in flight at once
    temperature: float = 1.0
    request_timeout_s: float = 600.0  # one completion, waits included (pauses for weight syncs, preemptions)
    retries: int = 3  # a failed request (5xx, connection) is retried this often before the run fails

    def __post_init__(self) -> None:
        for name in ("group_size", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"rollout.temperature must be in [0, 2], got {self.temperature}")
        if not self.request_timeout_s > 0 or self.retries < 0:
            raise ValueError("rollout.request_timeout_s must be > 0 and rollout.retries >= 0")


@dataclass(frozen=True)
class SampleResult:
    request_id: str  # the manager's request (one sample of the group's session)
    branch_id: int
    reward: float
    exact: bool
    min_version: int  # oldest policy version among its generated tokens
    max_version: int
    tokens: int  # generated tokens


@dataclass(frozen=True)
class GroupResult:
    group_id: int
    key: str  # the group's session id; unique across runs of one store: also its consumed-marker
    problem: Problem
    samples: tuple[SampleResult, ...]

    @property
    def min_version(self) -> int:
        return min(s.min_version for s in self.samples)

    @property
    def mean_reward(self) -> float:
        return sum(s.reward for s in self.samples) / len(self.samples)


class RolloutError(RuntimeError):
    """A sample could not be generated or rewarded after its retries: the run cannot go on."""


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
        self._headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._next_group = 0
        self.groups: dict[int, GroupResult] = {}  # finished (and not yet refreshed) groups
        self._problems: dict[int, Problem] = {}
        self._keys: dict[int, str] = {}  # group id -> its session id (and consumed-marker)
        self._adopted: deque[GroupResult] = deque()
        self._tasks: set[asyncio.Task] = set()
        self.failure: BaseException | None = None
        self.requests = 0  # completion requests (one per group, or per refresh of a group)

    async def __aenter__(self) -> RolloutManager:
        limit = self.config.max_concurrency
        self._http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit + 8))
        self._slots = asyncio.Semaphore(max(1, limit // self.config.group_size))  # a request holds a group
        return self

    async def __aexit__(self, *exc) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    # ---- what the control plane asks ----

    def submit(self, num_groups: int) -> list[int]:
        """Start `num_groups` groups: adopted ones first (they finish at once), then fresh training problems."""
        ids = []
        while self._adopted and len(ids) < num_groups:
            ids.append(self._adopt(self._adopted.popleft()))
        for problem in self.task.sample_train(self._rng, num_groups - len(ids)):
            gid, self._next_group = self._next_group, self._next_group + 1
            self._problems[gid], self._keys[gid] = problem, f"{self.run_id}-g{gid}"
            self._spawn(self._run_group(gid, range(self.config.group_size), {}))
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
        asyncio.get_running_loop().call_soon(self.on_group, group)  # after the Submit that asked for it
        return gid

    def refresh(self, group_ids: Sequence[int], min_keep_version: int) -> None:
        """Regenerate each sample of these finished groups that holds tokens older than `min_keep_version`."""
        for gid in group_ids:
            old = self.groups.pop(gid)
            kept = {i: s for i, s in enumerate(old.samples) if s.min_version >= min_keep_version}
            redo = [i for i in range(len(old.samples)) if i not in kept]
            self._spawn(self._run_group(gid, redo, kept))

    def take(self, group_ids: Sequence[int]) -> list[GroupResult]:
        """Remove finished groups for a training step."""
        return [self.groups.pop(gid) for gid in group_ids]

    async def evaluate(self, problems: Sequence[Problem], label: str) -> dict:
        """One sample of each problem (not trained on): mean reward and exact-match rate."""
        grades = await asyncio.gather(*(self._evaluate_one(p, f"{self.run_id}-eval-{label}-{i}")
                                        for i, p in enumerate(problems)))  # fmt: skip
        n = len(grades)
        return {"reward_mean": sum(g.reward for g in grades) / n, "exact_match": sum(g.exact for g in grades) / n,
                "problems": n}  # fmt: skip

    async def _evaluate_one(self, problem: Problem, sid: str):
        body = self._request(problem, 1)
        async with self._slots:
            answer = await self._post(f"/s/{sid}/v1/completions", body)
        return self.task.grade(problem, answer["choices"][0]["text"])

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

    async def _run_group(self, gid: int, indices: Sequence[int], kept: dict[int, SampleResult]) -> None:
        """Sample the group's problem len(indices) times in one request (`n`), grade each sample and write the
        rewards with the session; then the group (with the samples `kept` from before) is finished."""
        problem, sid = self._problems[gid], self.key(gid)
        body = self._request(problem, len(indices))
        async with self._slots:
            answer = await self._post(f"/s/{sid}/v1/completions", body)
        self.requests += 1
        fresh = [self._graded(problem, choice) for choice in answer["choices"]]
        samples = {**kept, **dict(zip(indices, fresh, strict=True))}
        ordered = tuple(samples[i] for i in sorted(samples))
        await self._post(f"/trajectories/{sid}", {
            "branch_rewards": {str(s.branch_id): s.reward for s in fresh},
            "task_id": problem.problem_id,
            "meta": {"group": sid, "problem": dataclasses.asdict(problem),
                     "request_rewards": {s.request_id: s.reward for s in ordered}},
        })  # fmt: skip
        group = GroupResult(gid, sid, problem, ordered)
        self.groups[gid] = group
        self.on_group(group)

    def _request(self, problem: Problem, n: int) -> dict:
        """The completions body for `n` samples of `problem` (seeded from the run's RNG, in call order)."""
        return {"prompt": problem.prompt, "max_tokens": problem.max_tokens or self.task.max_tokens,
                "ignore_eos": problem.ignore_eos, "n": n, "temperature": self.config.temperature,
                "seed": self._rng.getrandbits(62)}  # fmt: skip

    def _graded(self, problem: Problem, choice: dict) -> SampleResult:
        t = choice["trajectory"]
        grade = self.task.grade(problem, choice["text"])
        versions = t["versions"] or [0]
        return SampleResult(t["request_id"], t["branch_id"], grade.reward, grade.exact, min(versions), max(versions),
                            len(t["token_ids"]))  # fmt: skip

    async def _post(self, path: str, body: dict) -> dict:
        """POST with retries: a 5xx or a lost connection is retried `retries` times with backoff; a 429 (the
        manager sheds load) is retried after its Retry-After for as long as `request_timeout_s` allows."""
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        failures, last = 0, None
        while failures <= self.config.retries and asyncio.get_running_loop().time() < deadline:
            wait = min(5.0, 0.2 * 2**failures)
            try:
                async with self._http.post(self.base_url + path, json=body, headers=self._headers,
                                           timeout=timeout) as r:  # fmt: skip
                    data = await r.json(content_type=None)
                    if r.status == 200:
                        return data
                    last = f"HTTP {r.status}: {str(data)[:300]}"
                    if r.status == 429:
                        await asyncio.sleep(float(r.headers.get("Retry-After", 1)))
                        continue
                    if r.status < 500:
                        break  # our request is wrong: retrying will not help
            except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
                last = f"{type(e).__name__}: {e}"
            failures += 1
            await asyncio.sleep(wait)
        raise RolloutError(f"POST {path} failed: {last}")


def untrained_groups(store: TrajectoryStore) -> list[GroupResult]:
    """Every finished rollout group in the store that no training step consumed, oldest first (what a
    resumed run adopts, so that no finished group is lost)."""
    consumed = store.consumed()
    keys = [sid for sid in store.sessions() if sid not in consumed and "request_rewards" in
            store.annotations(sid).get("meta", {})]  # fmt: skip
    return stored_groups(store, keys)


def stored_groups(store: TrajectoryStore, keys: Sequence[str]) -> list[GroupResult]:
    """Finished groups as the rollout manager wrote them to the store (their current samples are the
    requests named in `meta.request_rewards`); group ids are assigned when they are adopted."""
    out = []
    for key in keys:
        notes = store.annotations(key)
        meta = notes.get("meta", {})
        if "problem" not in meta or "request_rewards" not in meta:
            raise ValueError(f"session {key!r} is not a finished rollout group (no problem or rewards)")
        rewards = meta["request_rewards"]
        records = {r.request_id: r for r in store.records(key)}
        samples = []
        for rid, reward in rewards.items():
            versions = records[rid].versions or (0,)
            samples.append(SampleResult(rid, -1, reward, reward >= 1.0, min(versions), max(versions),
                                        len(records[rid].token_ids)))  # fmt: skip
        out.append(GroupResult(-1, key, Problem(**meta["problem"]), tuple(samples)))
    return out


def training_batch(store: TrajectoryStore, groups: Sequence[GroupResult]) -> list[Trajectory]:
    """The trainer's records of these groups, read from the manager's durable store: exactly the tokens the
    engines consumed and produced, with their logprobs, versions and the rewards written with them."""
    out = []
    for g in groups:
        for record in request_records(store, g.key, [s.request_id for s in g.samples]):
            out.append(Trajectory.from_export(record, group_id=g.key))
    return out
