"""SWE-bench-format tasks for agentic RL: the task record, checkouts, grading rules, demonstrations, and an
offline suite of small buggy repositories (`swebench_env.suite`). See README.md in this folder.

Docker sandboxes, image builds, agents and the Docker grader build on these pieces; nothing here needs
Docker or the network (except checking out an official task from GitHub). The agent-side names (the
built-in agent, runners, rollouts, the demonstration engine) are imported on first use: they pull in
the OpenAI client, which the task tools do not need.
"""

import importlib

from swebench_env.demos import Demonstration, Step, replay, submitted_patch
from swebench_env.evaluation import Evaluation, Outcome, Verdict, evaluate_locally, grade, parse_pytest_log
from swebench_env.tasks import Instance, TaskFormatError, dump_tasks, load_tasks, materialize_repo

_LAZY = {
    "AgentConfig": "swebench_env.agent",
    "BashAgent": "swebench_env.agent",
    "Episode": "swebench_env.agent",
    "ExitReason": "swebench_env.agent",
    "CommandRunner": "swebench_env.runner",
    "LocalRunner": "swebench_env.runner",
    "InstanceResult": "swebench_env.rollout",
    "SweRolloutConfig": "swebench_env.rollout",
    "run_rollout": "swebench_env.rollout",
    "demonstration_engine": "swebench_env.scripted",
    "replay_demonstration": "swebench_env.scripted",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'swebench_env' has no attribute {name!r}")


__all__ = [
    *_LAZY,
    "Demonstration",
    "Evaluation",
    "Verdict",
    "Outcome",
    "Step",
    "Instance",
    "TaskFormatError",
    "dump_tasks",
    "evaluate_locally",
    "grade",
    "load_tasks",
    "materialize_repo",
    "parse_pytest_log",
    "replay",
    "submitted_patch",
]
