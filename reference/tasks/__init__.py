"""Verifiable tasks for RL training, chosen by name: `make_task("math")`; `throughput` is a workload (forced,
long-tailed response lengths) for measuring the runtime, not a task to learn; `swe` runs agents in sandboxes
on SWE-bench-format tasks (`swebench_env.training`), through the same episode seam.

Each entry maps a short name to a dotted path, imported only when asked for; an unknown name raises
a ValueError that lists the choices. A task of the user's own needs no entry: its class given as
`package.module:Class` (`--task examples.reverse_task:ReverseTask`, `task.name` in a config) is imported the
same way, in the driver and in every worker, from the Python path (the folder the run starts in is on it);
a path that does not import or names nothing there raises a ValueError saying which part failed.
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
    """The class registered under `name`, or the class at `name` given as `package.module:Class`."""
    path = TASKS.get(name)
    if path is None:
        if ":" not in str(name):
            raise ValueError(
                f"unknown task {name!r}; choose one of {sorted(TASKS)}, or give a task class of your "
                "own as package.module:Class"
            )
        path = name
    module, _, attr = path.partition(":")
    if not all(part.isidentifier() for part in module.split(".")) or not attr.isidentifier():
        raise ValueError(f"task {name!r}: a task class is given as package.module:Class")
    try:
        found = getattr(import_module(module), attr, None)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"task {name!r}: cannot import {module!r} ({e}); run from the folder that holds it or put it on PYTHONPATH"
        ) from None
    if not isinstance(found, type):
        raise ValueError(f"task {name!r}: module {module!r} has no class {attr!r}")
    return found


def make_task(name: str, **kwargs) -> Task:
    """An instance of the task registered under `name`; `kwargs` go to its config."""
    return task_class(name)(**kwargs)
