"""`python -m swebench_env COMMAND`: SWE-bench-format tasks.

suite     --out DIR: regenerate the offline suite into DIR and verify it; --verify: re-check a suite
validate  FILE: check a task file (JSON list or JSONL) against the schema
check     FILE: run each task's tests in its sandbox (empty patch fails, gold patch resolves)
derive-tests FILE: compute FAIL_TO_PASS and PASS_TO_PASS by running the tests before and after the gold patch
checkout  FILE ID DEST: check out one task's repository at its base commit
eval      --tasks FILE --predictions FILE --out DIR: grade SWE-bench predictions in Docker, report as SWE-bench does
rollout   --tasks FILE --base-url URL --out DIR: run an agent on tasks against a running manager, grade, store rewards
replay    --tasks FILE --demos FILE --out DIR: replay demonstrations through an in-process manager, grade them
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from core.cli import add_out_args, run_main


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swebench_env", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    suite = sub.add_parser("suite", help="regenerate (--out) or re-check (--verify) the offline task suite")
    suite.add_argument("--out", type=Path, help="write the suite here (e.g. swebench_env/data/suite), then verify it")
    suite.add_argument("--verify", action="store_true", help="re-check the suite in --dir")
    suite.add_argument("--dir", type=Path, default=None, help="the suite to verify (default: the shipped one)")
    suite.add_argument("--ids", nargs="+", default=None, help="verify only these instance ids")
    suite.add_argument("--no-verify", action="store_true", help="with --out: generate without running the checks")
    suite.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="tasks built or checked at once")
    validate = sub.add_parser("validate", help="check a task file against the schema")
    validate.add_argument("file", type=Path)
    check = sub.add_parser("check", help="run the tasks of a file with the empty and the gold patch in their sandbox")
    check.add_argument("file", type=Path)
    check.add_argument("--ids", nargs="+", default=None, help="check only these instance ids")
    check.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    derive = sub.add_parser(
        "derive-tests", help="compute FAIL_TO_PASS and PASS_TO_PASS from runs before and after the gold patch"
    )
    derive.add_argument("file", type=Path, help="task file (JSON or JSONL); the lists may be absent")
    derive.add_argument("--ids", nargs="+", default=None, help="derive only these instance ids")
    derive.add_argument("--out", type=Path, default=None, help="write the file with the derived lists here")
    derive.add_argument("--in-place", action="store_true", help="rewrite FILE with the derived lists")
    derive.add_argument("--runs", type=int, default=1, help="runs before and after; all must agree (flaky tests)")
    derive.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    for command in (check, derive):
        _sandbox_arguments(command)
    checkout = sub.add_parser("checkout", help="check out a task's repository at its base commit")
    checkout.add_argument("file", type=Path, help="task file (JSON or JSONL)")
    checkout.add_argument("instance_id")
    checkout.add_argument("dest", type=Path, help="an absent or empty folder")
    evaluate = sub.add_parser("eval", help="grade a SWE-bench predictions file in Docker sandboxes")
    evaluate.add_argument("--tasks", type=Path, required=True, help="task file (JSON or JSONL)")
    evaluate.add_argument(
        "--predictions",
        type=Path,
        required=True,
        help="predictions (JSON list, JSONL or an object keyed by instance id) with instance_id, "
        "model_patch, model_name_or_path",
    )
    add_out_args(evaluate, default=None, what="the reports' folder")
    evaluate.add_argument("--run-id", default=None, help="names the run's folder and summary (default: a fresh id)")
    evaluate.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 2), help="sandboxes at once")
    evaluate.add_argument("--timeout-s", type=float, default=300.0, help="each instance's test run")
    evaluate.add_argument(
        "--image",
        default=None,
        help="sandbox image for local-repository tasks (default: the offline base image, built on first use)",
    )
    _wheelhouse_argument(evaluate)
    _rollout_parsers(sub)
    return p


def _sandbox_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sandbox",
        choices=("docker", "local"),
        default="docker",
        help="where the tests run: each task's Docker sandbox, as grading runs them (default), or this "
        "machine's Python, unisolated (trusted tasks on a machine without Docker)",
    )
    p.add_argument(
        "--image",
        default=None,
        help="Docker image for tasks that name none (default: the offline base image, built on first use)",
    )
    p.add_argument("--timeout-s", type=float, default=300.0, help="each test run")
    _wheelhouse_argument(p)


def _wheelhouse_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wheelhouse",
        type=Path,
        default=None,
        help="a folder of wheels that tasks' install recipes "
        "are built from, offline (default: $SEAMLESSFLOW_WHEELHOUSE, else pip download)",
    )


def _rollout_parsers(sub) -> None:
    rollout = sub.add_parser("rollout", help="run an agent on tasks against a running manager; grade; store rewards")
    replay = sub.add_parser("replay", help="replay demonstrations through an in-process manager and grade them")
    for p in (rollout, replay):
        p.add_argument("--tasks", type=Path, required=True, help="task file (JSON or JSONL)")
        p.add_argument("--ids", nargs="+", default=None, help="only these instance ids")
        add_out_args(p, default=None, what="the results' folder")
        p.add_argument("--concurrency", type=int, default=4 if p is rollout else 2, help="episodes at once")
        p.add_argument("--command-timeout-s", type=float, default=60.0, help="each bash command")
        p.add_argument(
            "--sandbox",
            choices=("docker", "local"),
            default="docker",
            help="where commands and tests run: a Docker sandbox per episode and per grading (default), "
            "or this machine, unisolated (trusted tasks only)",
        )
        p.add_argument(
            "--image",
            default=None,
            help="Docker image for local-repository tasks (default: the offline base image, built on first use)",
        )
        _wheelhouse_argument(p)
    rollout.add_argument("--base-url", required=True, help="the trajectory manager, http://HOST:PORT")
    rollout.add_argument("--agent", default="builtin", help="the agent: builtin or mini-swe-agent")
    rollout.add_argument(
        "--mini-config",
        type=Path,
        default=None,
        help="for --agent mini-swe-agent: its config file "
        "(YAML with agent: and model: sections; default: the SWE-bench config it ships)",
    )
    rollout.add_argument(
        "--admin-token-file",
        type=Path,
        default=None,
        help="the manager's admin token (default: $SEAMLESSFLOW_ADMIN_TOKEN)",
    )
    rollout.add_argument("--run-id", default=None, help="session ids are RUN_ID:INSTANCE_ID (default: a fresh id)")
    rollout.add_argument("--max-turns", type=int, default=30, help="model calls an episode")
    rollout.add_argument("--max-tokens", type=int, default=None, help="per model call (default: the server's)")
    rollout.add_argument("--temperature", type=float, default=1.0)
    rollout.add_argument("--model", default=None, help="model name (default: the first the server lists)")
    replay.add_argument("--demos", type=Path, required=True, help="demonstrations (JSONL)")
    replay.add_argument("--tokenizer", default="default", help="'default' or a directory with tokenizer.json")


def suite(args: argparse.Namespace) -> int:
    from swebench_env.suite import SUITE_DIR, load_suite, load_suite_demonstrations
    from swebench_env.suite.build import generate_suite

    if (args.out is None) == (not args.verify):
        raise ValueError("give either --out DIR (regenerate and verify) or --verify [--dir DIR]")
    root = args.out or args.dir or SUITE_DIR
    if args.out is not None:
        start = time.perf_counter()
        built = generate_suite(args.out, jobs=args.jobs)
        size_kb = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file()) / 1024
        print(f"built {len(built)} tasks into {args.out} ({size_kb:.0f} KiB) in {time.perf_counter() - start:.1f} s")
        if args.no_verify:
            return 0
    tasks = _chosen(load_suite("all", root), args.ids, root)
    return _verify(tasks, {d.instance_id: d for d in load_suite_demonstrations("all", root)}, args.jobs)


def _chosen(tasks, ids: list[str] | None, where: Path):
    if not ids:
        return tasks
    unknown = sorted(set(ids) - {t.instance_id for t in tasks})
    if unknown:
        raise ValueError(f"no task {unknown[0]!r} in {where}; it has {len(tasks)} tasks")
    return [t for t in tasks if t.instance_id in ids]


def check(args: argparse.Namespace) -> int:
    from swebench_env.taskcheck import check_tasks, evaluator
    from swebench_env.tasks import load_tasks

    tasks = _chosen(load_tasks(args.file), args.ids, args.file)
    evaluate = evaluator(args.sandbox, args.image, args.timeout_s)
    return _report(lambda: check_tasks(tasks, evaluate, jobs=args.jobs))


def _verify(tasks, demos, jobs: int) -> int:
    from swebench_env.suite.verify import check_tasks

    return _report(lambda: check_tasks(tasks, demos, jobs=jobs))


def _report(run) -> int:
    start = time.perf_counter()
    checks = run()
    bad = [c for c in checks if not c.ok]
    for check in bad:
        for problem in check.problems:
            print(f"{check.instance_id}: {problem}", file=sys.stderr)
    seconds = time.perf_counter() - start
    print(f"verified {len(checks)} tasks in {seconds:.1f} s: {len(checks) - len(bad)} ok, {len(bad)} bad")
    return 1 if bad else 0


def derive_tests(args: argparse.Namespace) -> int:
    from swebench_env.taskcheck import derive_file, evaluator, updated_records, write_records

    if args.out is not None and args.in_place:
        raise ValueError("give --out FILE or --in-place, not both")
    start = time.perf_counter()
    evaluate = evaluator(args.sandbox, args.image, args.timeout_s)
    derived = derive_file(args.file, evaluate, args.ids, args.runs, args.jobs)
    verdicts = {"as in the file": 0, "differ from the file": 0, "errors": 0}
    for iid, result in derived.results.items():
        if not result.ok:
            print(f"{iid}: {result.problem}", file=sys.stderr)
            verdicts["errors"] += 1
            continue
        verdict = "as in the file" if derived.as_read(iid) == result.lists else "differ from the file"
        verdicts[verdict] += 1
        print(f"{iid}: {len(result.FAIL_TO_PASS)} FAIL_TO_PASS, {len(result.PASS_TO_PASS)} PASS_TO_PASS, {verdict}")
    out = args.file if args.in_place else args.out
    if out is not None:
        print(f"wrote {write_records(updated_records(derived, out), out, derived.as_list)}", file=sys.stderr)
    said = ", ".join(f"{n} {verdict}" for verdict, n in verdicts.items())
    print(f"derived {len(derived.results)} tasks in {time.perf_counter() - start:.1f} s: {said}")
    return 1 if verdicts["errors"] else 0


def validate(args: argparse.Namespace) -> int:
    from swebench_env.tasks import load_tasks

    tasks = load_tasks(args.file)
    print(f"{args.file}: {len(tasks)} valid tasks")
    return 0


def checkout(args: argparse.Namespace) -> int:
    from swebench_env.tasks import load_tasks, materialize_repo

    tasks = {t.instance_id: t for t in load_tasks(args.file)}
    if args.instance_id not in tasks:
        raise ValueError(f"no task {args.instance_id!r} in {args.file}; it has {len(tasks)} tasks")
    task = tasks[args.instance_id]
    print(materialize_repo(task, args.dest))
    return 0


def evaluate(args: argparse.Namespace) -> int:
    from swebench_env.harness import eval_command

    return eval_command(args)


def rollout(args: argparse.Namespace) -> int:
    from swebench_env.rollout import rollout_command
    from swebench_env.tasks import load_tasks

    return rollout_command(args, _chosen(load_tasks(args.tasks), args.ids, args.tasks))


def replay(args: argparse.Namespace) -> int:
    from swebench_env.scripted import replay_command
    from swebench_env.tasks import load_tasks

    return replay_command(args, _chosen(load_tasks(args.tasks), args.ids, args.tasks))


def _use_wheelhouse(path: Path | None) -> None:
    """--wheelhouse DIR: what $SEAMLESSFLOW_WHEELHOUSE says, for every image this process builds."""
    from swebench_env.environments import WHEELHOUSE_ENV, given_wheelhouse

    if path is not None:
        os.environ[WHEELHOUSE_ENV] = str(given_wheelhouse(path))


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    commands = {
        "suite": suite,
        "validate": validate,
        "check": check,
        "derive-tests": derive_tests,
        "checkout": checkout,
        "eval": evaluate,
        "rollout": rollout,
        "replay": replay,
    }
    return run_main(
        lambda: _run(commands[args.command], args),
        usage_errors=(ValueError, FileNotFoundError, FileExistsError),
        failures=(RuntimeError,),  # a task that cannot be built, or git failing: not the user's typing (exit code 1)
    )


def _run(command, args: argparse.Namespace) -> int:
    _use_wheelhouse(getattr(args, "wheelhouse", None))
    return command(args)
