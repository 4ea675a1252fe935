"""The shipped offline task suite: small pure-Python libraries with one injected bug per task.

```
load_suite("train")                     # list[Task]; "held_out" or "all" for the others
load_suite_demonstrations("train")      # list[Demonstration], one per task
```

The data lives in `swebench_env/data/suite/`: `train.jsonl` and `held_out.jsonl` (SWE-bench records
whose `repo_path` points at `repos/<instance_id>.bundle`), `demonstrations/<split>.jsonl`, and
`manifest.json`. `python -m swebench_env suite --out DIR` regenerates it from `libs/` (see
`build.py`), `python -m swebench_env suite --verify` re-checks it (see `verify.py`).
"""

from __future__ import annotations

from pathlib import Path

from swebench_env.demos import Demonstration, load_demonstrations
from swebench_env.suite.build import HELD_OUT_LIBRARIES, SPLITS
from swebench_env.tasks import Instance, load_tasks

SUITE_DIR = Path(__file__).resolve().parent.parent / "data" / "suite"

__all__ = ["HELD_OUT_LIBRARIES", "SPLITS", "SUITE_DIR", "load_suite", "load_suite_demonstrations"]


def _splits(split: str) -> tuple[str, ...]:
    if split == "all":
        return SPLITS
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {[*SPLITS, 'all']}")
    return (split,)


def load_suite(split: str = "train", root: Path = SUITE_DIR) -> list[Instance]:
    """The suite's tasks of `split` ("train", "held_out" or "all"), in a fixed order."""
    return [t for s in _splits(split) for t in load_tasks(Path(root) / f"{s}.jsonl")]


def load_suite_demonstrations(split: str = "train", root: Path = SUITE_DIR) -> list[Demonstration]:
    """The demonstrations of `split`'s tasks, in the same order as `load_suite(split)`."""
    return [d for s in _splits(split) for d in load_demonstrations(Path(root) / "demonstrations" / f"{s}.jsonl")]
