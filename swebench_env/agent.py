"""The built-in agent: a compact bash-tool agent that speaks the OpenAI chat API, one manager session an episode.

The agent knows nothing of training: it is given an OpenAI base URL, `{manager}/s/{session_id}/v1`,
and the trajectory manager records every token behind it. It offers the model two function tools,
`bash` (run one command in the runner, from the checkout's root, in a fresh shell) and `submit` (end
the episode), sends the task's problem statement, then loops: call the model, run the tool calls it
made, send back each call's exit code and output (long outputs keep their head and tail).

The ideas follow mini-swe-agent (one command per step in a fresh shell, failures as observations, a
turn limit) with native tool calls instead of a bash block in markdown. A reply with no valid tool call
gets a format-error message and counts against the turn limit. 429 and 503 answers and lost
connections are retried with backoff (Retry-After honoured); past `max_retries`, or on any other
API error, the episode ends with that reason. Whatever the reason, the prediction is the checkout's
final diff against the base commit (as SWE-agent submits on exit), leaving out the test files that
judge the task: SWE-bench resets them before grading.

Besides the `submit` tool, a bash command whose output starts with `demos.SUBMIT_MARKER` submits too:
the convention the shipped demonstrations (and mini-swe-agent) use.
"""

from __future__ import annotations

import enum
import functools
import json
import random
import shlex
import time
from dataclasses import asdict, dataclass

import openai

from swebench_env.demos import SUBMIT_MARKER
from swebench_env.evaluation import judged_files
from swebench_env.runner import CommandRunner
from swebench_env.tasks import Instance

SYSTEM_PROMPT = """You are a software engineer who fixes issues in code repositories. You work only through tools:
- `bash` runs one command in a fresh shell in the repository's root: `cd` and variables do not carry over, so \
chain commands with `&&`. Commands cannot be interactive: no editors or pagers; edit files with `sed`, a here-document \
or a Python script.
- `submit` ends the task; your changes to the repository's files are what you submit.
In each reply, say briefly what you think and then call one tool."""

INSTANCE_PROMPT = """Fix this issue in the repository:

<issue>
{problem_statement}
</issue>

Find the cause in the source code, change the code (not the tests) so that the issue is fixed, check the change, \
then call `submit`. A command is stopped after {timeout_s:g} seconds; long outputs are shortened."""

FORMAT_ERROR = (
    "Your reply had no valid tool call. Call exactly one tool in each reply: `bash` with "
    '{"command": "..."} to run a command, or `submit` when the fix is done.'
)
CUT_OFF = "Your reply was cut off at the token limit. "

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a bash command in a new shell in the repository's root; see its exit code and output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "the command line to run"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Submit your changes to the repository as the fix, and end the task.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
RETRIED_STATUSES = (429, 503)  # overloaded manager, no engine in service: worth waiting for


class ExitReason(enum.StrEnum):
    SUBMITTED = "submitted"  # the model called `submit` (or ran the submit command)
    TURN_LIMIT = "turn_limit"  # `max_turns` model calls without a submit
    FORMAT_ERRORS = "format_errors"  # too many replies in a row without a valid tool call (mini-swe-agent's rule)
    CONTEXT_LIMIT = "context_limit"  # the conversation outgrew the model's context (a 400 from the server)
    API_ERROR = "api_error"  # any other API error, or retries exhausted: infrastructure, not the policy


@dataclass(frozen=True)
class AgentConfig:
    max_turns: int = 30  # model calls an episode (a reply without a valid tool call counts as one)
    command_timeout_s: float = 60.0  # each bash command
    max_observation_chars: int = 8000  # output shown to the model per command (head and tail kept)
    max_tokens: int | None = None  # per model call; None: the server's default
    temperature: float = 1.0
    model: str | None = None  # None: the first model the server lists
    workdir: str | None = None  # where commands run in the runner (the checkout); None: the runner's default
    request_timeout_s: float = 600.0  # one model call
    max_retries: int = 4  # on 429, 503 and lost connections
    retry_base_s: float = 1.0  # backoff: base * 2**attempt, jittered, at most retry_max_s
    retry_max_s: float = 30.0
    diff_timeout_s: float = 120.0  # reading the final diff
    seed: int | None = None  # sent with every model call (the server varies it by turn); None: the server draws

    def __post_init__(self) -> None:
        positive = ("max_turns", "command_timeout_s", "max_observation_chars", "request_timeout_s", "diff_timeout_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"AgentConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"AgentConfig.max_tokens must be >= 1 or None, got {self.max_tokens!r}")
        if not 0 <= self.temperature <= 2:
            raise ValueError(f"AgentConfig.temperature must be in [0, 2], got {self.temperature!r}")
        if self.max_retries < 0 or self.retry_base_s < 0 or self.retry_max_s < 0:
            raise ValueError("AgentConfig.max_retries, retry_base_s and retry_max_s must be >= 0")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ValueError(f"AgentConfig.seed must be None or an integer in [0, 2**63), got {self.seed!r}")


@dataclass(frozen=True)
class Episode:
    """One agent episode: the contract between the agent and whoever grades and records it."""

    instance_id: str
    session_id: str
    exit_reason: ExitReason
    turns: int  # model calls made
    format_errors: int  # replies without a valid tool call, and calls of unknown tools or with bad arguments
    commands: int  # bash commands run
    patch: str  # the final diff against the base commit ("" if nothing changed or it could not be read)
    error: str | None  # the API error that ended the episode, or why the diff could not be read
    model_s: float  # waiting for the model (retries included)
    commands_s: float  # running commands (the final diff included)
    total_s: float

    def to_dict(self) -> dict:
        return asdict(self) | {"exit_reason": str(self.exit_reason)}


class _EpisodeEnd(Exception):
    def __init__(self, reason: ExitReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class _State:
    """The running episode's conversation and counters (private to `BashAgent.run`)."""

    messages: list[dict]
    rng: random.Random  # backoff jitter, seeded by the session id
    turns: int = 0
    format_errors: int = 0
    commands: int = 0
    model_s: float = 0.0
    commands_s: float = 0.0
    submitted: bool = False


def session_base_url(manager_url: str, session_id: str) -> str:
    """The OpenAI base URL of one session of the manager at `manager_url` (http://HOST:PORT)."""
    return f"{manager_url.rstrip('/')}/s/{session_id}/v1"


def instance_messages(task: Instance, config: AgentConfig) -> list[dict]:
    """The conversation's opening: the system prompt and the task's problem statement."""
    user = INSTANCE_PROMPT.format(problem_statement=task.problem_statement.strip(), timeout_s=config.command_timeout_s)
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


@functools.cache
def shared_http_client() -> openai.DefaultHttpxClient:
    """One connection pool for every episode of this process: an OpenAI client's own pool builds a TLS context
    (tens of ms of CPU) even for a plain-HTTP manager, and its connections would not outlive the episode. The
    per-request timeout is the OpenAI client's; the pool is never closed (it lives as long as the process)."""
    return openai.DefaultHttpxClient()


class BashAgent:
    """`BashAgent(config).run(task, runner, manager_url, session_id)` -> Episode (see the module docstring)."""

    def __init__(self, config: AgentConfig | None = None, api_key: str = "none") -> None:
        self.config = config or AgentConfig()
        self.api_key = api_key

    def run(self, task: Instance, runner: CommandRunner, manager_url: str, session_id: str) -> Episode:
        start = time.monotonic()
        state = _State(instance_messages(task, self.config), random.Random(session_id))
        client = openai.OpenAI(
            base_url=session_base_url(manager_url, session_id),
            api_key=self.api_key,
            max_retries=0,
            timeout=self.config.request_timeout_s,
            http_client=shared_http_client(),
        )
        reason, error = self._loop(client, runner, state)
        diff_start = time.monotonic()
        patch, diff_error = final_patch(task, runner, self.config)
        state.commands_s += time.monotonic() - diff_start
        return Episode(
            task.instance_id,
            session_id,
            reason,
            state.turns,
            state.format_errors,
            state.commands,
            patch,
            error or diff_error,
            state.model_s,
            state.commands_s,
            time.monotonic() - start,
        )

    def _loop(self, client: openai.OpenAI, runner: CommandRunner, state: _State) -> tuple[ExitReason, str | None]:
        try:
            model = self.config.model or self._retrying(state, lambda: _first_model(client))
            while state.turns < self.config.max_turns:
                self._turn(client, model, runner, state)
                if state.submitted:
                    return ExitReason.SUBMITTED, None
        except _EpisodeEnd as end:
            return end.reason, str(end)
        return ExitReason.TURN_LIMIT, None

    def _turn(self, client: openai.OpenAI, model: str, runner: CommandRunner, state: _State) -> None:
        """One model call and the tool calls it made."""
        state.turns += 1
        choice = self._retrying(state, lambda: self._complete(client, model, state.messages)).choices[0]
        message = choice.message
        calls = message.tool_calls or []
        reply: dict = {"role": "assistant", "content": message.content}
        if calls:  # sent back as received, so the manager splices in the exact tokens it sampled
            reply["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ]
        state.messages.append(reply)
        if not calls:
            state.format_errors += 1
            prefix = CUT_OFF if choice.finish_reason == "length" else ""
            state.messages.append({"role": "user", "content": prefix + FORMAT_ERROR})
            return
        for call in calls:
            seen = self._act(call.function.name, call.function.arguments, runner, state)
            if state.submitted:
                return
            state.messages.append({"role": "tool", "tool_call_id": call.id, "content": seen})

    def _complete(self, client: openai.OpenAI, model: str, messages: list[dict]):
        extra = {} if self.config.max_tokens is None else {"max_tokens": self.config.max_tokens}
        if self.config.seed is not None:
            extra["seed"] = self.config.seed
        return client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, temperature=self.config.temperature, **extra
        )

    def _act(self, name: str, arguments: str, runner: CommandRunner, state: _State) -> str:
        """Run one tool call; its observation (an unknown tool or bad arguments is a format error)."""
        if name == "submit":
            state.submitted = True
            return "submitted"
        command = _command(arguments)
        if name != "bash" or command is None:
            state.format_errors += 1
            what = f"there is no tool {name!r}" if name != "bash" else 'its arguments must be {"command": "..."}'
            return f"That call was not run: {what}. " + FORMAT_ERROR
        start = time.monotonic()
        result = runner.exec(command, self.config.command_timeout_s, self.config.workdir)
        state.commands_s += time.monotonic() - start
        state.commands += 1
        if result.exit_code == 0 and result.output.partition("\n")[0].strip() == SUBMIT_MARKER:
            state.submitted = True
        return observation(result.exit_code, result.output, result.timed_out, self.config)

    def _retrying(self, state: _State, call):
        """`call()`, retried on 429/503 and lost connections; an `_EpisodeEnd` when it cannot succeed."""
        attempt = 0
        while True:
            start = time.monotonic()
            try:
                return call()
            except openai.APIStatusError as e:
                if e.status_code == 400 and e.code == "context_length_exceeded":
                    raise _EpisodeEnd(ExitReason.CONTEXT_LIMIT, _describe(e)) from None
                if e.status_code not in RETRIED_STATUSES or attempt >= self.config.max_retries:
                    raise _EpisodeEnd(ExitReason.API_ERROR, _describe(e)) from None
                wait_s = max(_retry_after_s(e), self._backoff_s(attempt, state.rng))
            except openai.APIConnectionError as e:  # refused, reset, timed out
                if attempt >= self.config.max_retries:
                    raise _EpisodeEnd(ExitReason.API_ERROR, f"{type(e).__name__}: {e}") from None
                wait_s = self._backoff_s(attempt, state.rng)
            finally:
                state.model_s += time.monotonic() - start
            attempt += 1
            time.sleep(wait_s)
            state.model_s += wait_s

    def _backoff_s(self, attempt: int, rng: random.Random) -> float:
        return min(self.config.retry_max_s, self.config.retry_base_s * 2**attempt) * (0.5 + rng.random() / 2)


def _first_model(client: openai.OpenAI) -> str:
    models = client.models.list().data
    if not models:
        raise _EpisodeEnd(ExitReason.API_ERROR, "the server lists no model; name one in AgentConfig.model")
    return models[0].id


def _command(arguments: str) -> str | None:
    """The `command` of a bash call's JSON arguments, or None when they are not {"command": str}."""
    try:
        parsed = json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return None
    command = parsed.get("command") if isinstance(parsed, dict) else None
    return command if isinstance(command, str) and command.strip() else None


def observation(exit_code: int, output: str, timed_out: bool, config: AgentConfig) -> str:
    """What the model sees of a command: its exit code (or the timeout) and its output, head and tail kept."""
    limit = config.max_observation_chars
    if len(output) > limit:
        left_out = len(output) - limit
        output = f"{output[: limit // 2]}\n[... {left_out} characters left out ...]\n{output[-(limit // 2) :]}"
    head = f"The command was stopped after {config.command_timeout_s:g} s." if timed_out else f"exit code {exit_code}"
    return f"{head}\n{output}" if output else f"{head}\n(no output)"


def diff_command(task: Instance) -> str:
    """The shell command that prints the checkout's changes against the base commit as one git patch: new
    files included, the task's judged test files and Python bytecode left out."""
    excluded = [f":(exclude,literal){path}" for path in judged_files(task)]
    excluded += [":(exclude,glob)**/__pycache__/**", ":(exclude,glob)**/*.pyc"]
    diff = [
        "git",
        "-c",
        "core.quotepath=false",
        "diff",
        "--cached",
        "--binary",
        "--no-color",
        "--no-ext-diff",
        task.base_commit,
        "--",
        ".",
        *excluded,
    ]
    return f"git add -A >/dev/null 2>&1; {shlex.join(diff)}"


def final_patch(task: Instance, runner: CommandRunner, config: AgentConfig) -> tuple[str, str | None]:
    """(the checkout's diff, None) or ("", why it could not be read)."""
    result = runner.exec(diff_command(task), config.diff_timeout_s, config.workdir)
    if result.timed_out or result.exit_code != 0:
        return "", f"could not read the final diff (exit code {result.exit_code}): {result.output[-500:]}"
    if result.truncated:
        return "", "the final diff is longer than the runner's output limit"
    return result.output, None


def _describe(e: openai.APIStatusError) -> str:
    """`HTTP <code>: <the server's message>`, whatever the openai client's version makes of the error body."""
    body = e.body.get("error", e.body) if isinstance(e.body, dict) else None
    message = body.get("message") if isinstance(body, dict) else None
    return f"HTTP {e.status_code}: {message if isinstance(message, str) else e.message}"[:1000]


def _retry_after_s(e: openai.APIStatusError) -> float:
    try:
        return max(0.0, float(e.response.headers.get("retry-after", 0)))
    except (TypeError, ValueError):
        return 0.0
