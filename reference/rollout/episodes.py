"""The episode seam: the one place where a task meets the rollout, whatever kind of task it is.

The group rollout (`groups.RolloutManager`) asks a task for `n` episodes of one problem
(`Task.episodes(problem, n, key, ctx)`) and gets back `Episode` records: where the episode's tokens lie
in the trajectory manager's store (a session and the requests of it that make the episode) and what it
earned. It never looks inside: a math problem is an episode of one request
(`reference.tasks.base.single_turn_episodes`: the group's `n` samples are one request with `n` choices in one
session); a SWE task is an agent working in a
sandbox over many turns in a session of its own, then graded (`swebench_env.training`). The rollout
manager, the trainer and the driver do not branch on the kind of task.

An episode that yields no verdict on the policy (the manager unreachable, the sandbox or the grader
failing) has `reward=None` and is dropped from its group: a 0 would teach the policy something false.

**Trajectories from episodes, each token trained once** (`episode_records`). An agent's session is a
prefix tree: usually one branch, several when the agent rewrites its history (trims an observation,
drops a rejected reply). Exporting every branch with the episode's reward would train the shared early
turns once per branch and count the episode once per branch in its group's mean. The rule here:

- each request of the episode trains exactly its own generated tokens; prompt tokens (the system and
  user messages, tool calls' outputs, and earlier turns' replies re-sent as history) are context only;
- to keep sequences few, a request whose whole sequence (prompt + reply) is a prefix of a later
  request's prompt is folded into that later request's record (its reply marked generated there, with
  its own log-probs and versions): an agent that only appends gives one record, as long as its last
  turn; each rewrite of the history starts another record;
- every record of an episode carries the episode's reward and its `episode_id`; the group's advantage is
  computed over episodes (`trainer.advantages.group_advantages`), so an episode counts once in its
  group whatever number of records it has. The loss is the step's token mean, as for single turns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp

from reference.export import request_records

if TYPE_CHECKING:
    from reference.manager.store import TrajectoryStore


# Seconds an episode spent, named as the simulator's SWE workload (and the wait for its sandboxes to start).
TIMING_KEYS = ("model_s", "tool_latency_s", "test_run_s", "episode_s", "sandbox_wait_s")
# Info key: what the episode's sandboxes did, [(lane, kind, start, end), ...] in unix seconds, kind a
# core.tags.SandboxPhase value; the runtime executor puts them on the run's timeline as sandbox lanes.
SANDBOX_SPANS = "sandbox_spans"


@dataclass(frozen=True)
class Episode:
    """One finished episode: where its tokens are in the manager's store and what it earned."""

    session_id: str  # the manager session that holds its requests
    request_ids: tuple[str, ...]  # the requests that make the episode (none only without a reward)
    reward: float | None  # None: no verdict on the policy (an infrastructure failure); dropped from training
    exact: bool  # a full success (the math answer exact, the SWE task resolved)
    min_version: int  # oldest policy version among its generated tokens
    max_version: int
    tokens: int  # generated tokens
    exit_reason: str = "finished"  # how it ended: finished, turn_limit, context_limit, api_error, crashed, ...
    trained: bool = True  # False: its reward counts in its group's baseline, none of its tokens is trained
    info: dict = dataclasses.field(default_factory=dict, compare=False)  # kind-specific facts (turns, patch...)

    def __post_init__(self) -> None:
        if not self.request_ids and self.reward is not None:
            raise ValueError(f"episode in session {self.session_id!r} names no request, so it cannot have a reward")
        if self.reward is not None and not -1e9 < self.reward < 1e9:
            raise ValueError(f"episode reward must be a finite number or None, got {self.reward!r}")

    @property
    def rewarded(self) -> bool:
        return self.reward is not None

    def to_meta(self) -> dict:
        """What the group record keeps of it (JSON): its place in the store, its verdict, and the timing facts
        of `info` (seconds waiting for the model, for tools in the sandbox, for the test run)."""
        timings = {k: v for k, v in self.info.items() if k in TIMING_KEYS}
        return {
            "session_id": self.session_id,
            "request_ids": list(self.request_ids),
            "reward": self.reward,
            "exact": self.exact,
            "exit_reason": self.exit_reason,
            "trained": self.trained,
            **timings,
        }


class EpisodeContext:
    """What a task's episodes may use: the manager's URL, the run's sampling settings and RNG, and HTTP calls
    with the rollout's retry rules. Made by the rollout manager; one per run."""

    def __init__(
        self,
        base_url: str,
        http: aiohttp.ClientSession,
        headers: dict,
        temperature: float,
        request_timeout_s: float,
        retries: int,
        rng: random.Random,
        fixed_seed: int | None = None,
    ) -> None:
        self.base_url, self.temperature = base_url.rstrip("/"), temperature
        self.admin_headers = headers  # the manager's admin token (rewards and annotations need it)
        self._http, self._timeout_s, self._retries, self._rng = http, request_timeout_s, retries, rng
        self.fixed_seed = fixed_seed  # set: every episode's sampling seed is fixed by it (`episode_seed`)

    def seed(self) -> int:
        """A sampling seed from the run's RNG (deterministic in call order)."""
        return self._rng.getrandbits(62)

    def with_fixed_seeds(self, base: int) -> EpisodeContext:
        """This context, but each episode's seed a function of `base`, its problem and its index
        (`episode_seed`): evaluations with one base draw the same numbers for the same episode, so two
        evaluations of different weights differ by the weights and not by the draws (common random numbers)."""
        return EpisodeContext(
            self.base_url,
            self._http,
            self.admin_headers,
            self.temperature,
            self._timeout_s,
            self._retries,
            self._rng,
            fixed_seed=base,
        )

    def episode_seed(self, problem_id: str, index: int) -> int | None:
        """The sampling seed of episode `index` of a problem: fixed by `fixed_seed` and both, or None (the
        engine draws one) when no seed is fixed."""
        if self.fixed_seed is None:
            return None
        digest = hashlib.blake2b(f"{self.fixed_seed}:{problem_id}:{index}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> 2  # in [0, 2**62)

    def session_url(self, session_id: str) -> str:
        """The OpenAI base URL of a session: what an agent is given."""
        return f"{self.base_url}/s/{session_id}/v1"

    async def get(self, path: str) -> dict | None:
        """GET from the manager (with the admin token); None for a 404, RolloutError for any other failure."""
        timeout = aiohttp.ClientTimeout(total=self._timeout_s)
        try:
            async with self._http.get(self.base_url + path, headers=self.admin_headers, timeout=timeout) as r:
                data = await r.json(content_type=None)
                if r.status == 404:
                    return None
                if r.status == 200:
                    return data
                raise RolloutError(f"GET {path} failed: HTTP {r.status}: {str(data)[:300]}")
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as e:
            raise RolloutError(f"GET {path} failed: {type(e).__name__}: {e}") from None

    async def post(self, path: str, body: dict) -> dict:
        """POST to the manager with retries: a 5xx or a lost connection is retried `retries` times with
        backoff; a 429 (the manager sheds load) after its Retry-After for as long as the timeout allows."""
        loop = asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=self._timeout_s)
        deadline = loop.time() + self._timeout_s
        failures, last = 0, None
        while failures <= self._retries and loop.time() < deadline:
            wait = min(5.0, 0.2 * 2**failures)
            try:
                async with self._http.post(
                    self.base_url + path, json=body, headers=self.admin_headers, timeout=timeout
                ) as r:
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


class RolloutError(RuntimeError):
    """An episode could not be generated or recorded after its retries: the run cannot go on."""


# ---- the training records of an episode (the rule in the module docstring) ----


def episode_records(store: TrajectoryStore, episodes: Sequence[Episode]) -> list[list[dict]]:
    """Each episode's training records, in `reference.export.request_records`' format (token_ids,
    generated_mask, logprobs and versions with None on context positions, reward = the episode's): every
    generated token of an episode's requests is generated in exactly one of its records. The store is read
    once per session, however many episodes share it (a single-turn group's do)."""
    by_session: dict[str, list[int]] = {}
    for i, e in enumerate(episodes):
        by_session.setdefault(e.session_id, []).append(i)
    out: list[list[dict]] = [[] for _ in episodes]
    for sid, indices in by_session.items():
        wanted = {rid for i in indices for rid in episodes[i].request_ids}
        stored = store.records(sid)
        order = [r.request_id for r in stored if r.request_id in wanted]
        missing = wanted.difference(order)
        if missing:
            raise ValueError(f"no request {sorted(missing)[0]!r} in session {sid!r} of {store.path}")
        loaded = {r["request_id"]: r for r in request_records(store, sid, order, stored)}
        position = {rid: k for k, rid in enumerate(order)}
        for i in indices:
            rids = sorted(episodes[i].request_ids, key=position.__getitem__)
            out[i] = _folded([loaded[rid] for rid in rids], episodes[i].reward)
    return out


def _folded(records: Sequence[dict], reward: float | None) -> list[dict]:
    """One episode's request records (in request order) with each folded into the first later one whose
    prompt holds its whole sequence."""
    out: list[dict] = []
    for record in records:  # fresh dicts and lists from `request_records`: changed in place
        mask = record["generated_mask"]
        prompt_len = mask.index(1) if 1 in mask else len(mask)
        kept = []
        for earlier in out:
            if _folds_into(earlier, record, prompt_len):
                _overlay(record, earlier)
            else:
                kept.append(earlier)
        out = [*kept, record]
    for record in out:
        record["reward"] = reward
    return out


def _folds_into(earlier: dict, later: dict, later_prompt_len: int) -> bool:
    """Whether `earlier`'s whole sequence lies inside `later`'s prompt (so `later` can carry its reply)."""
    n = len(earlier["token_ids"])
    return n <= later_prompt_len and later["token_ids"][:n] == earlier["token_ids"]


def _overlay(later: dict, earlier: dict) -> None:
    """Mark `earlier`'s generated positions generated in `later`, with their log-probs and versions."""
    for i, generated in enumerate(earlier["generated_mask"]):
        if generated:
            later["generated_mask"][i] = 1
            later["logprobs"][i] = earlier["logprobs"][i]
            later["versions"][i] = earlier["versions"][i]
    later["request_ids"] = [
        *earlier.get("request_ids", [earlier["request_id"]]),
        *later.get("request_ids", [later["request_id"]]),
    ]
