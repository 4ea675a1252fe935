"""`python -m reference train`'s output folder, checked before anything starts: one `error:` line and exit 2
for a file, an uncreatable or a non-empty `--out`; `--overwrite`; unique default folders; provenance in
config.yaml; Ctrl-C as one line and exit 130. Training itself is replaced by a fake that stops at once."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import yaml

from reference.cli import main


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def started(monkeypatch) -> list[tuple[str, Path]]:
    """Training that records (policy, folder) and stops as Ctrl-C would, before any process starts."""
    import reference.train

    runs: list[tuple[str, Path]] = []

    def fake_train(cfg, out, progress=True, resume=False):
        runs.append((cfg.policy.name, out))
        raise KeyboardInterrupt

    monkeypatch.setattr(reference.train, "train", fake_train)
    return runs


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err.rstrip("\n")


def interrupted_line(capsys) -> str:
    """After Ctrl-C: the config files merged, the line announcing the run, then one line saying where its outputs
    are."""
    note, announced, *rest = capsys.readouterr().err.splitlines()
    assert note.startswith("config: ") and note.endswith("train.yaml"), note
    assert announced.startswith("training math under "), announced
    assert len(rest) == 1, rest
    return rest[0]


def test_an_out_that_cannot_be_created(capsys, tmp_path, started):
    (tmp_path / "file").write_text("mine")
    assert main(["train", "--out", str(tmp_path / "file" / "run")]) == 2
    assert one_line(capsys) == f"error: --out '{tmp_path}/file/run' cannot be created: Not a directory"
    assert tree(tmp_path) == ["file"]
    assert started == []


def test_a_non_empty_out_is_refused_before_anything_starts(capsys, tmp_path, started):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert main(["train", "--out", str(tmp_path)]) == 2
    assert one_line(capsys) == f"error: --out '{tmp_path}' is not empty; choose a new folder or pass --overwrite"
    assert tree(tmp_path) == ["metrics.jsonl"]
    assert started == []


def test_overwrite_refuses_the_current_folder(capsys, tmp_path, monkeypatch, started):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["train", "--out", ".", "--overwrite"]) == 2
    assert one_line(capsys) == "error: --overwrite refuses to clear '.': it is the current folder"
    assert tree(tmp_path) == ["notes.txt"]


def test_overwrite_clears_the_last_run_then_starts(capsys, tmp_path, started):
    (tmp_path / "checkpoints" / "step-5").mkdir(parents=True)
    (tmp_path / "reward.png").write_bytes(b"old")
    assert main(["train", "--out", str(tmp_path), "--overwrite"]) == 130
    assert started == [("tag", tmp_path)]
    assert tree(tmp_path) == ["config.yaml"]  # written before training starts (--resume reads it)
    assert interrupted_line(capsys) == f"interrupted (Ctrl-C); outputs written so far are in {tmp_path}/"


def test_ctrl_c_names_the_checkpoint_to_resume_from(capsys, tmp_path, monkeypatch, started):
    import reference.train

    def fake_train(cfg, out, progress=True, resume=False):
        (out / "checkpoints" / "step-2").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(reference.train, "train", fake_train)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out)]) == 130
    assert interrupted_line(capsys) == (
        f"interrupted (Ctrl-C); outputs written so far are in {out}/; "
        f"`python -m reference train --resume {out}` continues from its last checkpoint"
    )


def test_sigterm_stops_a_run_as_ctrl_c_does(capsys, tmp_path, monkeypatch, started):
    """`kill`, `docker stop` or a service manager: the same clean stop (the task's sandboxes removed on the way
    out), one line, exit code 143; the previous SIGTERM handler is back afterwards."""
    import os
    import signal

    import reference.train

    def fake_train(cfg, out, progress=True, resume=False):
        (out / "metrics.jsonl").write_text("")
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(reference.train, "train", fake_train)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "run"
    assert main(["train", "--out", str(out)]) == 143
    assert interrupted_line(capsys) == f"stopped (SIGTERM); outputs written so far are in {out}/"
    assert signal.getsignal(signal.SIGTERM) is before


def test_default_folders_never_collide(capsys, tmp_path, monkeypatch, started):
    monkeypatch.chdir(tmp_path)
    for seed in ("0", "0", "1"):
        assert main(["train", "--seed", seed]) == 130
    folders = [out.name for _, out in started]
    assert len(set(folders)) == 3
    assert [name.startswith("train-tag-") for name in folders] == [True] * 3
    assert [name.split("-seed")[1] for name in folders] in (["0", "0-2", "1"], ["0", "0", "1"])
    assert sorted(folders) == sorted(p.name for p in (tmp_path / "results").iterdir())


def test_config_yaml_records_the_policy_the_command_and_the_source(capsys, tmp_path, monkeypatch, started):
    argv = ["train", "--compare", "--out", str(tmp_path / "cmp")]
    monkeypatch.setattr(sys, "argv", ["reference/__main__.py", *argv])
    assert main(argv) == 130  # stopped in the first policy of the five
    saved = yaml.safe_load((tmp_path / "cmp" / "colocated" / "config.yaml").read_text())
    record = saved["provenance"]
    assert record["policy"] == "colocated"
    assert record["argv"] == ["reference/__main__.py", *argv]
    assert len(record["source"]["configs_sha256"]) == 64
    assert "git_commit" in record["source"] or "version" in record["source"]


def test_resume_reads_a_config_with_provenance(capsys, tmp_path, started):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--policy", "async", "--steps", "7"]) == 130
    assert main(["train", "--resume", str(out)]) == 130
    assert started == [("async", out), ("async", out)]


def test_resume_reads_a_config_written_before_newer_keys_existed(capsys, tmp_path, started):
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--policy", "tag", "--steps", "7"]) == 130
    saved = yaml.safe_load((out / "config.yaml").read_text())
    del saved["policy"]["drain"], saved["run"]["held_out_samples"], saved["engine"]["coalesce_s"]
    (out / "config.yaml").write_text(yaml.safe_dump(saved))
    assert main(["train", "--resume", str(out)]) == 130
    assert started == [("tag", out), ("tag", out)]


def test_an_evaluation_note_says_how_many_episodes_each_split_gets():
    from types import SimpleNamespace

    from reference.control.run import _per_problem

    assert _per_problem(SimpleNamespace(eval_samples=1, held_out_samples=None)) == "1 episode a problem"
    assert _per_problem(SimpleNamespace(eval_samples=2, held_out_samples=2)) == "2 episodes a problem"
    two_one = _per_problem(SimpleNamespace(eval_samples=2, held_out_samples=1))
    assert two_one == "2 episodes a training problem, 1 episode a held-out one"


def test_an_evaluation_runs_its_own_count_of_episodes_on_the_held_out_split():
    import asyncio
    from types import SimpleNamespace

    from reference.control.run import evaluate_splits

    asked = []

    class Rollout:
        async def evaluate(self, problems, label, samples):
            asked.append((label, len(problems), samples))
            return {"exact_match": 0.0}

    task = SimpleNamespace(held_out=lambda: ["h"] * 9, train_problems=lambda: ["t"] * 32)
    result = asyncio.run(evaluate_splits(Rollout(), task, "end", 2, 1))
    assert sorted(asked) == [("end-held", 9, 1), ("end-train_", 32, 2)]
    assert result == {"exact_match": 0.0, "train_exact_match": 0.0}
    asked.clear()
    asyncio.run(evaluate_splits(Rollout(), task, "end", 3))
    assert sorted(asked) == [("end-held", 9, 3), ("end-train_", 32, 3)]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stderr", "shown"), [(Terminal(), True), (io.StringIO(), False)])
def test_the_progress_bar_only_on_a_terminal(monkeypatch, stderr, shown):
    from reference.control.report import Progress

    monkeypatch.setattr(sys, "stderr", stderr)
    with Progress(3) as progress:
        assert progress.bar.disable is not shown
        progress.update({"reward_mean": 0.25, "tokens_per_s_trained": 1234.5})
        progress.update({"reward_mean": 0.25, "tokens_per_s_trained": 1234.5, "trained_tokens": 4000, "time_s": 2.0,
                         "staleness": {"0": 10, "1": 30}})  # fmt: skip
    lines = [line for line in stderr.getvalue().splitlines() if line.startswith("step ")]
    # no terminal (a log file): one plain line a step instead of the bar's frames
    assert lines == ([] if shown else ["step 1/3  reward 0.250  0 gen tok/s  staleness 0.00  0 s",
                                       "step 2/3  reward 0.250  2,000 gen tok/s  staleness 0.75  2 s"])  # fmt: skip


@pytest.mark.parametrize(("stderr", "shown"), [(Terminal(), True), (io.StringIO(), False)])
def test_an_evaluation_says_what_it_does_with_or_without_a_terminal(monkeypatch, stderr, shown):
    from reference.control.report import Progress
    from reference.control.run import evaluation_line

    monkeypatch.setattr(sys, "stderr", stderr)
    with Progress(3) as progress:
        progress.note(evaluation_line("start", {"exact_match": 0.0, "train_exact_match": 0.59375}))
    assert "evaluation start: held-out 0.000, train 0.594" in stderr.getvalue()
    with Progress(3, enabled=False) as quiet:
        quiet.note("not shown")
    assert "not shown" not in stderr.getvalue()
