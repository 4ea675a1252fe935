"""`python -m swebench_env eval`: grade a SWE-bench predictions file in Docker and report as SWE-bench's harness does.

    python -m swebench_env eval --tasks FILE --predictions FILE --out DIR [--run-id ID] [--jobs N]

Predictions are SWE-bench's: a JSON list, JSONL, or a JSON object keyed by instance id, each record with
`instance_id`, `model_patch` (a unified diff; "" or null for none) and `model_name_or_path`. Every
prediction for a known task with a non-empty patch is graded in a fresh sandbox (`grading.DockerGrader`),
`--jobs` at a time, with a progress bar. The outputs follow SWE-bench's `run_evaluation`:

    DIR/<run_id>/<model>/<instance_id>/  patch.diff, test_output.txt, run_instance.log, report.json
    DIR/<model>.<run_id>.json             the summary (make_run_report's fields, schema_version 2)

where <model> is `model_name_or_path` with "/" written "__". As there, an empty patch is counted in
`empty_patch_ids` and not run, a patch that does not apply or an instance that could not be graded is
an error (no report.json), and a task without a prediction is incomplete. Bad input costs only its
own item, with one line on stderr: a task record that breaks the schema, a prediction for an unknown
instance, a duplicate, a record with missing fields, a patch that is not a diff.

When the `swebench` package is installed, each graded log is also read by its `get_eval_report`; an
instance where its verdict differs from ours is listed in the summary's `grader_disagreements` (and
said on stderr), so a disagreement cannot pass unseen.
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from core.outputs import prepare_out, show_progress
from swebench_env.evaluation import MAINTAINED, PASSING, Evaluation, passed
from swebench_env.grading import GradingError, swebench_resolved
from swebench_env.tasks import Instance

FIELDS = ("instance_id", "model_patch", "model_name_or_path")
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
_DIFF = re.compile(r"^(diff --git |--- \S)", re.MULTILINE)
MAX_LINES_SAID = 20  # bad-input lines printed per kind; the rest are counted


@dataclass(frozen=True)
class Prediction:
    instance_id: str
    model_patch: str | None
    model_name_or_path: str

    @property
    def model_dir(self) -> str:
        return self.model_name_or_path.replace("/", "__")


def load_predictions(path: Path, problems: list[str]) -> list[Prediction]:
    """The well-formed predictions of a file; a line in `problems` for each record that is not."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"predictions file {path} does not exist") from None
    except OSError as e:  # a folder, no permission
        raise ValueError(f"predictions file {path} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"predictions file {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    records: list[tuple[str, Any]] = []
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")) and not _is_jsonl(stripped):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"predictions file {path}: not valid JSON: {e}") from None
        if isinstance(data, dict):  # keyed by instance id, as SWE-bench also accepts
            records = [(f"{path} key {k!r}", v) for k, v in data.items()]
        else:
            records = [(f"{path} item {i}", v) for i, v in enumerate(data)]
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    records.append((f"{path} line {number}", json.loads(line)))
                except json.JSONDecodeError as e:
                    records.append((f"{path} line {number}", e))
    return [p for place, record in records if (p := _prediction(place, record, problems)) is not None]


def _is_jsonl(text: str) -> bool:
    """JSON lines when the first line is a whole object that is a prediction (it names its instance) or is
    followed by more lines; a single-line object of objects is keyed by instance id."""
    first = text.split("\n", 1)[0].strip()
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(record, dict) and ("instance_id" in record or "\n" in text.strip())


def _prediction(place: str, record: Any, problems: list[str]) -> Prediction | None:
    if isinstance(record, json.JSONDecodeError):
        problems.append(f"{place}: not valid JSON: {record}")
        return None
    if not isinstance(record, dict):
        problems.append(f"{place}: expected a JSON object with {list(FIELDS)}, got {type(record).__name__}")
        return None
    missing = [f for f in FIELDS if f not in record]
    if missing:
        problems.append(f"{place}: missing field(s) {missing}; a prediction needs {list(FIELDS)}")
        return None
    iid, patch, model = (record[f] for f in FIELDS)
    if not isinstance(iid, str) or not SAFE_NAME.fullmatch(iid):
        problems.append(f"{place}: instance_id {iid!r} is not an instance id (letters, digits and _.-)")
        return None
    if patch is not None and not isinstance(patch, str):
        problems.append(f"{place}: instance {iid!r}: model_patch must be a string or null, got {type(patch).__name__}")
        return None
    if not isinstance(model, str) or not SAFE_NAME.fullmatch(model.replace("/", "__")) or ".." in model:
        problems.append(f"{place}: instance {iid!r}: model_name_or_path {model!r} must be letters, digits, _.-/")
        return None
    return Prediction(iid, patch, model)


@dataclass(frozen=True)
class Graded:
    prediction: Prediction
    evaluation: Evaluation | None  # None: not graded (error)
    error: str | None  # why it is an error instance
    swebench_resolved: bool | None  # the swebench package's verdict on the same log (None: not asked)
    seconds: float


def report_entry(task: Instance, prediction: Prediction, evaluation: Evaluation) -> dict:
    """The instance's report.json, as SWE-bench's `get_eval_report(..., include_tests_status=True)` writes it."""
    statuses = evaluation.statuses
    trusted = evaluation.problem is None

    def split(tests: tuple[str, ...], ok) -> dict[str, list[str]]:
        good = passed(tests, statuses, ok) if trusted else []
        return {"success": good, "failure": [t for t in tests if t not in good]}

    entry = {
        "patch_is_None": prediction.model_patch is None,
        "patch_exists": prediction.model_patch is not None,
        "patch_successfully_applied": evaluation.applied and trusted,
        "resolved": evaluation.resolved,
    }
    if trusted:
        entry["tests_status"] = {
            "FAIL_TO_PASS": split(task.FAIL_TO_PASS, PASSING),
            "PASS_TO_PASS": split(task.PASS_TO_PASS, MAINTAINED),
            "FAIL_TO_FAIL": {"success": [], "failure": []},
            "PASS_TO_FAIL": {"success": [], "failure": []},
        }
    return {task.instance_id: entry}


def grade_one(
    task: Instance, prediction: Prediction, grader: Callable[[Instance, str], Evaluation], out: Path
) -> Graded:
    """Grade one prediction and write its folder; never raises for this instance's own failure."""
    folder = out / prediction.model_dir / task.instance_id
    folder.mkdir(parents=True, exist_ok=True)
    patch = prediction.model_patch or ""
    (folder / "patch.diff").write_text(patch, encoding="utf-8")
    start = time.monotonic()
    lines = [f"instance {task.instance_id}: {len(patch)} bytes of patch from {prediction.model_name_or_path}"]
    evaluation = verdict = None
    if not _DIFF.search(patch):
        error = f"instance {task.instance_id!r}: model_patch is not a unified diff ({patch[:40]!r}...); not graded"
    else:
        try:
            evaluation = grader(task, patch)
            error = None if evaluation.applied else f"instance {task.instance_id!r}: the patch does not apply"
        except GradingError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - one instance's failure must not end a batch of hundreds
            error = f"instance {task.instance_id!r}: grading failed: {type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    if evaluation is not None:
        (folder / "test_output.txt").write_text(evaluation.log, encoding="utf-8")
        verdict = swebench_resolved(task, evaluation.log, patch)
        lines.append(
            f"graded in {seconds:.1f} s: resolved={evaluation.resolved}"
            + (f" ({evaluation.problem})" if evaluation.problem else "")
        )
    if error is None:
        report = report_entry(task, prediction, evaluation)
        (folder / "report.json").write_text(json.dumps(report, indent=4) + "\n", encoding="utf-8")
    else:
        lines.append(f"error (no report, as in SWE-bench's harness): {error}")
    (folder / "run_instance.log").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return Graded(prediction, evaluation, error, verdict, seconds)


def evaluate(
    tasks: Sequence[Instance],
    predictions: Sequence[Prediction],
    out: Path,
    run_id: str,
    grader: Callable[[Instance, str], Evaluation],
    jobs: int = 2,
    problems: list[str] | None = None,
    progress: bool = False,
) -> dict:
    """Grade `predictions` against `tasks` into `out` (see the module docstring); returns the summary. Bad
    predictions (unknown instance, duplicate, not a diff) get a line in `problems`."""
    problems = problems if problems is not None else []
    by_id = {t.instance_id: t for t in tasks}
    chosen: dict[str, Prediction] = {}
    for p in predictions:
        if p.instance_id not in by_id:
            problems.append(f"prediction for unknown instance {p.instance_id!r}: not in the task file; skipped")
        elif p.instance_id in chosen:
            problems.append(f"instance {p.instance_id!r}: more than one prediction; the first is graded")
        else:
            chosen[p.instance_id] = p
    run_dir = out / run_id
    to_grade = [p for p in chosen.values() if p.model_patch]
    graded: list[Graded] = []
    bar = tqdm(total=len(to_grade), desc="eval", unit="instance", disable=not show_progress(progress), leave=False)
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="grade") as pool:
        futures = [pool.submit(grade_one, by_id[p.instance_id], p, grader, run_dir) for p in to_grade]
        try:
            for future in as_completed(futures):
                graded.append(future.result())
                bar.set_postfix(resolved=sum(not g.error and g.evaluation.resolved for g in graded))
                bar.update(1)
        finally:
            for f in futures:
                f.cancel()
            bar.close()
    return _summary(tasks, list(chosen.values()), graded, problems)


def _summary(tasks: Sequence[Instance], chosen: list[Prediction], graded: list[Graded], problems: list[str]) -> dict:
    errors = sorted(g.prediction.instance_id for g in graded if g.error)
    completed = [g for g in graded if not g.error]
    resolved = sorted(g.prediction.instance_id for g in completed if g.evaluation.resolved)
    problems.extend(g.error for g in sorted(graded, key=lambda g: g.prediction.instance_id) if g.error)
    disagree = sorted(
        g.prediction.instance_id
        for g in graded
        if g.swebench_resolved is not None and g.swebench_resolved != g.evaluation.resolved
    )
    for iid in disagree:
        problems.append(f"instance {iid!r}: the swebench package grades this log differently; see its test_output.txt")
    predicted = {p.instance_id for p in chosen}
    summary = {
        "total_instances": len(tasks),
        "submitted_instances": len(chosen),
        "completed_instances": len(completed),
        "resolved_instances": len(resolved),
        "unresolved_instances": len(completed) - len(resolved),
        "empty_patch_instances": sum(not p.model_patch for p in chosen),
        "error_instances": len(errors),
        "completed_ids": sorted(g.prediction.instance_id for g in completed),
        "incomplete_ids": sorted(t.instance_id for t in tasks if t.instance_id not in predicted),
        "empty_patch_ids": sorted(p.instance_id for p in chosen if not p.model_patch),
        "submitted_ids": sorted(predicted),
        "resolved_ids": resolved,
        "unresolved_ids": sorted(g.prediction.instance_id for g in completed if not g.evaluation.resolved),
        "error_ids": errors,
        "schema_version": 2,
    }
    if any(g.swebench_resolved is not None for g in graded):
        summary["grader_disagreements"] = disagree
    return summary


# ---- the command line (the parser is in cli.py) ----


def eval_command(args) -> int:
    """`python -m swebench_env eval`: 0 when everything given was graded, 1 when some instance was an error."""
    from swebench_env.grading import DockerGrader, DockerGraderConfig
    from swebench_env.tasks import load_tasks

    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    problems: list[str] = []
    tasks = load_tasks(args.tasks, problems)
    predictions = load_predictions(args.predictions, problems)
    models = sorted({p.model_name_or_path for p in predictions})
    if not models:
        _say(problems)
        raise ValueError(f"no usable prediction in {args.predictions}")
    run_id = args.run_id or f"eval-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    if not SAFE_NAME.fullmatch(run_id):
        raise ValueError(f"--run-id {run_id!r}: use letters, digits and _.-")
    grader = DockerGrader(DockerGraderConfig(image=args.image, test_timeout_s=args.timeout_s))
    out = prepare_out(args.out, args.out, args.overwrite)
    summaries = {}
    for model in models:  # SWE-bench writes one summary a model
        mine = [p for p in predictions if p.model_name_or_path == model]
        summary = evaluate(tasks, mine, out, run_id, grader, args.jobs, problems, progress=True)
        name = out / f"{mine[0].model_dir}.{run_id}.json"
        name.write_text(json.dumps(summary, indent=4) + "\n", encoding="utf-8")
        summaries[name] = summary
    _say(problems)
    for name, s in summaries.items():
        print(
            f"{name.name}: {s['resolved_instances']}/{s['total_instances']} resolved, "
            f"{s['unresolved_instances']} unresolved, {s['empty_patch_instances']} empty, "
            f"{s['error_instances']} errors, {len(s['incomplete_ids'])} without a prediction"
        )
    print(f"reports in {out}/{run_id}/", file=sys.stderr)
    return 1 if any(s["error_instances"] for s in summaries.values()) else 0


def _say(problems: list[str]) -> None:
    for line in problems[:MAX_LINES_SAID]:
        print(f"warning: {line}", file=sys.stderr)
    if len(problems) > MAX_LINES_SAID:
        print(f"warning: ... and {len(problems) - MAX_LINES_SAID} more like these", file=sys.stderr)
