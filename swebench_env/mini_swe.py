"""mini-swe-agent, unmodified, as a rollout agent: its own agent loop, prompts and model class, talking to
the trajectory manager as it would to any OpenAI-compatible server.

    python -m swebench_env rollout --agent mini-swe-agent --tasks FILE --base-url http://HOST:PORT --out DIR

`MiniSweAgent(config).run(task, runner, manager_url, session_id)` builds the three parts mini-swe-agent
is made of and runs them as its own `mini` command would:
- the agent: `minisweagent.agents.default.DefaultAgent` with the `agent:` section of a mini-swe-agent
  config file (by default the one it ships for SWE-bench, `benchmarks/swebench.yaml`: its system and
  instance prompts, with the task's problem statement as `{{task}}`);
- the model: `minisweagent.models.litellm_model.LitellmModel` (native tool calls, one `bash` tool; or,
  with `model_class: litellm_textbased`, its text-based model that reads a bash block) with the
  config's `model:` section, pointed at the session's base URL `{manager}/s/{session_id}/v1` as
  `openai/<served model>`. The manager records every token behind it; cost tracking is off (a local
  model has no price);
- the environment: `RunnerEnvironment`, which runs each command in our `CommandRunner` (a Docker sandbox
  with the checkout at /testbed, or a local checkout) and ends the episode as mini-swe-agent's own
  environments do: a command that exits 0 and whose output's first line is
  `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` submits the rest of its output.

What maps onto an `Episode`: `AgentConfig.max_turns` is mini-swe-agent's `step_limit` (model calls),
`command_timeout_s` each command's timeout, `temperature` and `max_tokens` are sent with every call and
`request_timeout_s` bounds one call. The prediction is the submission when the agent submitted one
(mini-swe-agent's SWE-bench runs grade exactly that), and otherwise (step limit, repeated format errors,
API error, or a submission the runner cut short) the checkout's diff against the base commit, as the
built-in agent does. Exit statuses: Submitted -> `submitted`, LimitsExceeded -> `turn_limit`,
RepeatedFormatError -> `format_errors`, a context-window error -> `context_limit`, any other API error ->
`api_error` (no reward: it says nothing about the policy). mini-swe-agent retries failed calls itself
(tenacity, 4 to 60 s apart); the number of attempts is `AgentConfig.max_retries + 1` unless
`MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT` is set.

mini-swe-agent is imported on first use (it prints a banner and reads `~/.config/mini-swe-agent/.env`
on import; both are silenced or harmless here): `pip install -e '.[swe]'` brings it.
"""

from __future__ import annotations

import importlib
import os
import shlex
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from core.errors import UserError
from swebench_env.agent import AgentConfig, Episode, ExitReason, final_patch, session_base_url
from swebench_env.demos import SUBMIT_MARKER
from swebench_env.runner import CommandRunner
from swebench_env.tasks import Instance

DEFAULT_CONFIG = "benchmarks/swebench.yaml"  # under mini-swe-agent's shipped config folder
# mini-swe-agent's model classes that reach any OpenAI-compatible server through litellm's `api_base`: native
# tool calls (its default) or a bash block in the reply's text (its `mini_textbased.yaml`).
MODEL_CLASSES = {
    "": "minisweagent.models.litellm_model.LitellmModel",
    "litellm": "minisweagent.models.litellm_model.LitellmModel",
    "litellm_textbased": "minisweagent.models.litellm_textbased_model.LitellmTextbasedModel",
}
_ENV_DEFAULTS = {
    "MSWEA_SILENT_STARTUP": "1",  # no banner on import
    "MSWEA_COST_TRACKING": "ignore_errors",  # a local model has no price
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm: no download of its price list at import
}
_import_lock = threading.Lock()


def _minisweagent():
    """Import mini-swe-agent quietly; a UserError when it is not installed."""
    with _import_lock:
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        try:
            import litellm
            import minisweagent
            from minisweagent.agents.default import DefaultAgent
            from minisweagent.config import builtin_config_dir
            from minisweagent.exceptions import Submitted
            from minisweagent.models.litellm_model import LitellmModel

            litellm.suppress_debug_info = True  # no "Provider List" banner on stderr when it cannot price a model
        except ModuleNotFoundError as e:
            raise UserError(
                f"--agent mini-swe-agent needs the mini-swe-agent package ({e}); "
                "install it with: pip install -e '.[swe]'"
            ) from None
    return minisweagent, DefaultAgent, LitellmModel, Submitted, builtin_config_dir


def load_config(path: str | Path | None = None) -> dict[str, Any]:
    """A mini-swe-agent config file (YAML with `agent:` and `model:` sections): `path`, or the SWE-bench one it
    ships. A UserError naming the file when it cannot be read or lacks the agent's templates."""
    if path is None:
        path = Path(_minisweagent()[4]) / DEFAULT_CONFIG
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"mini-swe-agent config {str(path)!r} cannot be read: {e}") from None
    agent = config.get("agent") if isinstance(config, dict) else None
    templates = ("system_template", "instance_template")
    if not isinstance(agent, dict) or not all(isinstance(agent.get(k), str) for k in templates):
        raise UserError(
            f"mini-swe-agent config {str(path)!r}: 'agent' must hold 'system_template' and 'instance_template' strings"
        )
    model = config.get("model", {})
    if not isinstance(model, dict):
        raise UserError(f"mini-swe-agent config {str(path)!r}: 'model' must be a mapping, got {type(model).__name__}")
    if model.get("model_class", "") not in MODEL_CLASSES:
        raise UserError(
            f"mini-swe-agent config {str(path)!r}: model_class {model['model_class']!r} cannot talk to the "
            f"trajectory manager; use one of: {', '.join(c for c in MODEL_CLASSES if c)}"
        )
    env = config.get("environment", {})
    return {"agent": agent, "model": model, "environment": env if isinstance(env, dict) else {}}


class RunnerEnvironment:
    """A mini-swe-agent environment (its `Environment` protocol) that runs commands in a `CommandRunner`.

    Each command runs in a fresh shell in the checkout (`cwd`, else the runner's default), with the config's
    environment variables exported first; a command past `timeout_s` is stopped and reported as mini-swe-agent's
    own environments report it. Counts commands and the time spent in them."""

    def __init__(
        self, runner: CommandRunner, timeout_s: float, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.runner = runner
        self.timeout_s = timeout_s
        self.cwd = cwd
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.config = {"cwd": cwd or "", "timeout": timeout_s, "env": self.env}
        self.commands = 0
        self.seconds = 0.0
        self.submission_cut_short = False

    def execute(self, action: dict, cwd: str = "", *, timeout: float | None = None) -> dict[str, Any]:
        from minisweagent.exceptions import Submitted

        command = action.get("command", "")
        exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in self.env.items() if k.isidentifier())
        limit = timeout or self.timeout_s
        start = time.monotonic()
        result = self.runner.exec(exports + command, limit, cwd or self.cwd)
        self.seconds += time.monotonic() - start
        self.commands += 1
        output: dict[str, Any] = {"output": result.output, "returncode": result.exit_code, "exception_info": ""}
        if result.timed_out:
            output["exception_info"] = f"An error occurred while executing the command: timed out after {limit:g} s"
            output["extra"] = {"exception_type": "TimeoutExpired", "exception": f"timed out after {limit:g} s"}
        lines = result.output.lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and result.exit_code == 0 and not result.timed_out:
            self.submission_cut_short = result.truncated
            submission = "".join(lines[1:])
            raise Submitted(
                {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
            )
        return output

    def get_template_vars(self, **kwargs) -> dict[str, Any]:
        return {**self.config, **kwargs}

    def serialize(self) -> dict:
        return {
            "info": {
                "config": {"environment": dict(self.config), "environment_type": f"{__name__}.{type(self).__name__}"}
            }
        }


_EXIT_REASONS = {
    "Submitted": ExitReason.SUBMITTED,
    "LimitsExceeded": ExitReason.TURN_LIMIT,
    "TimeExceeded": ExitReason.TURN_LIMIT,
    "RepeatedFormatError": ExitReason.FORMAT_ERRORS,
}


class MiniSweAgent:
    """`MiniSweAgent(config).run(task, runner, manager_url, session_id)` -> Episode (see the module docstring).

    `config_file`: a mini-swe-agent config (YAML) to use instead of its shipped SWE-bench one."""

    def __init__(
        self, config: AgentConfig | None = None, api_key: str = "none", config_file: str | Path | None = None
    ) -> None:
        self.config = config or AgentConfig()
        self.api_key = api_key
        self.mini_config = load_config(config_file)
        os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", str(self.config.max_retries + 1))

    def run(self, task: Instance, runner: CommandRunner, manager_url: str, session_id: str) -> Episode:
        import openai

        _, DefaultAgent, _, _, _ = _minisweagent()
        model_class = self.model_class()
        start = time.monotonic()
        base_url = session_base_url(manager_url, session_id)
        env = RunnerEnvironment(
            runner, self.config.command_timeout_s, self.config.workdir, self.mini_config["environment"].get("env")
        )
        error: str | None = None
        agent = None
        try:
            model = model_class(**self._model_config(base_url))
            agent_config = {
                **self.mini_config["agent"],
                "step_limit": self.config.max_turns,
                "cost_limit": 0.0,
                "output_path": None,
            }
            agent = DefaultAgent(model, env, **agent_config)
            status = agent.run(task.problem_statement.strip()).get("exit_status", "")
            reason = _EXIT_REASONS.get(status, ExitReason.API_ERROR)
            if reason is ExitReason.API_ERROR:
                error = f"mini-swe-agent ended with {status!r}"
        except openai.APIError as e:  # litellm's exceptions are the openai client's
            reason = ExitReason.CONTEXT_LIMIT if _context_exceeded(e) else ExitReason.API_ERROR
            error = f"{type(e).__name__}: {e}"[:1000]
        messages = agent.messages if agent is not None else []
        submission = messages[-1].get("extra", {}).get("submission", "") if reason is ExitReason.SUBMITTED else ""
        diff_start = time.monotonic()
        if submission and not env.submission_cut_short:
            patch, diff_error = submission, None
        else:
            patch, diff_error = final_patch(task, runner, self.config)
        commands_s = env.seconds + time.monotonic() - diff_start
        turns = agent.n_calls if agent is not None else 0
        format_errors = sum(1 for m in messages if m.get("extra", {}).get("interrupt_type") == "FormatError")
        total_s = time.monotonic() - start
        return Episode(
            task.instance_id,
            session_id,
            reason,
            turns,
            format_errors,
            env.commands,
            patch,
            error or diff_error,
            max(0.0, total_s - commands_s),
            commands_s,
            total_s,
        )

    def model_class(self) -> type:
        """The mini-swe-agent model class the config names (`model_class`; its tool-call model by default)."""
        module, _, name = MODEL_CLASSES[self.mini_config["model"].get("model_class", "")].rpartition(".")
        return getattr(importlib.import_module(module), name)

    def _model_config(self, base_url: str) -> dict[str, Any]:
        served = self.config.model or _first_model(base_url, self.api_key, self.config.request_timeout_s)
        kwargs = dict(self.mini_config["model"].get("model_kwargs") or {})
        kwargs |= {
            "api_base": base_url,
            "api_key": self.api_key,
            "temperature": self.config.temperature,
            "timeout": self.config.request_timeout_s,
        }
        if self.config.max_tokens is not None:
            kwargs["max_tokens"] = self.config.max_tokens
        if self.config.seed is not None:  # one seed on every call: the manager varies it by turn
            kwargs["seed"] = self.config.seed
        ours = ("model_name", "model_kwargs", "model_class")
        model = {k: v for k, v in self.mini_config["model"].items() if k not in ours}
        return model | {"model_name": f"openai/{served}", "model_kwargs": kwargs, "cost_tracking": "ignore_errors"}


def _first_model(base_url: str, api_key: str, timeout_s: float) -> str:
    import openai

    with openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2, timeout=timeout_s) as client:
        models = client.models.list().data
    if not models:
        raise openai.APIError("the server lists no model; name one in AgentConfig.model", request=None, body=None)
    return models[0].id


def _context_exceeded(e: Exception) -> bool:
    import litellm

    return isinstance(e, litellm.exceptions.ContextWindowExceededError) or "context_length_exceeded" in str(e)
