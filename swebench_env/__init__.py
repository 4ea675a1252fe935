"""SWE-bench-format tasks for agentic RL: the task record, checkouts, grading rules, demonstrations, and an
offline suite of small buggy repositories (`swebench_env.suite`). See README.md in this folder.

Docker sandboxes, image builds, agents and the Docker grader build on these pieces; nothing here needs
Docker or the network (except checking out an official task from GitHub).
"""

from swebench_env.demos import Demonstration, Step, replay, submitted_patch
from swebench_env.evaluation import Evaluation, Grade, Outcome, evaluate_locally, grade, parse_pytest_log
from swebench_env.tasks import Task, TaskFormatError, dump_tasks, load_tasks, materialize_repo

__all__ = [
    "Demonstration",
    "Evaluation",
    "Grade",
    "Outcome",
    "Step",
    "Task",
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
