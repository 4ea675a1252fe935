"""Verifiable tasks for RL training, chosen by name: `make_task("math")`; `throughput` is a workload (forced,
long-tailed response lengths) for measuring the runtime, not a task to learn; `swe` runs agents in sandboxes
on SWE-bench-format tasks (`swebench_env.training`), through the same episode seam.

Each entry maps a short name to a dotted path, imported only when asked for; an unknown name raises
a ValueError that lists the choices.
"""

from __future__ import annotations

from importlib import import_module

from reference.tasks.base import Grade, Problem, SingleTurn, Task

TASKS = {
    "math": "reference.tasks.math:MathTask",
    "throughput": "reference.tasks.throughput:ThroughputTask",
    "swe": "swebench_env.training:SweTask",  # agents in sandboxes on SWE-bench-format tasks
}

__all__ = ["TASKS", "Grade", "Problem", "SingleTurn", "Task", "make_task", "task_class"]


def task_class(name: str) -> type:
    """The class registered under `name`."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    module, attr = TASKS[name].split(":")
    return getattr(import_module(module), attr)


def make_task(name: str, **kwargs) -> Task:
    """An instance of the task registered under `name`; `kwargs` go to its config."""
    return task_class(name)(**kwargs)
