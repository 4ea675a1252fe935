"""`python -m reference train`'s run logging: a line a step where stderr is not a terminal, TensorBoard event files
and W&B where asked for, and one `error:` line when the package for either is missing."""

from __future__ import annotations

import io
import sys
import types

import pytest

from core.run_log import ScalarLog, read_scalars
from reference.cli import main
from reference.control.report import MetricsLog, Progress, logging_to

pytest.importorskip("tensorboardX")


def record(step: int, reward: float, tokens: int, time_s: float, lags: dict) -> dict:
    """A step's record as the runtime executor writes it to metrics.jsonl (the figures the sink gets)."""
    return {"step": step, "reward_mean": reward, "reward_std": 0.1, "exact_match": reward, "samples": 16,
            "trained_tokens": tokens, "generated_tokens": tokens // 2, "staleness": lags, "loss": 0.5 - step / 10,
            "kl": float("nan"), "tokens_per_s_trained": 999.0, "time_s": time_s, "step_s": 2.0,
            "episodes": {"exit_reasons": {"stop": 16}, "tool_s_sum": 1.5}}  # fmt: skip


RECORDS = [record(0, 0.25, 2000, 2.0, {"0": 1000}), record(1, 0.5, 4000, 4.0, {"0": 500, "1": 1500}),
           record(2, 0.75, 6000, 10.0, {"1": 3000})]  # fmt: skip


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_a_step_when_stderr_is_a_file(monkeypatch):
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    with Progress(500) as progress:
        for r in RECORDS:
            progress.update(r)
    assert stderr.getvalue().splitlines() == [
        "step 1/500  reward 0.250  1,000 gen tok/s  staleness 0.00  2 s",
        "step 2/500  reward 0.500  1,500 gen tok/s  staleness 0.75  4 s",  # (2000 + 4000) / 4 s; lag 1 on 3/4
        "step 3/500  reward 0.750  1,200 gen tok/s  staleness 1.00  10 s",
    ]


def test_held_out_evaluations_go_to_a_section_of_their_own(tmp_path):
    """Each evaluation's scores at the steps done when it ran (0: before RL), under `eval/`, beside `train/`."""
    with logging_to(ScalarLog(tmp_path / "tb")):
        metrics = MetricsLog(tmp_path / "metrics.jsonl")
        metrics.held_out(0, {"label": "start", "time_s": 0.0, "reward_mean": 0.03, "exact_match": 0.0})
        metrics.held_out(10, {"label": "v10", "time_s": 5.0, "reward_mean": 0.4, "exact_match": 0.25, "samples": 64})
    found = read_scalars(tmp_path / "tb")
    assert set(found) == {"eval/reward_mean", "eval/exact_match"}
    assert found["eval/reward_mean"] == [(0, pytest.approx(0.03)), (10, pytest.approx(0.4))]
    assert found["eval/exact_match"] == [(0, 0.0), (10, 0.25)]


def test_a_terminal_keeps_the_bar_and_quiet_prints_nothing(monkeypatch):
    for stderr, enabled in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stderr)
        with Progress(3, enabled=enabled) as progress:
            progress.update(RECORDS[0])
        assert "step 1/3  reward" not in stderr.getvalue()


def test_tensorboard_event_files_hold_each_steps_metrics(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with logging_to(ScalarLog(tmp_path / "tb")):
        with Progress(3, enabled=False) as progress:  # --quiet: no lines, still logged
            for r in RECORDS:
                progress.update(r)
    found = read_scalars(tmp_path / "tb")
    assert [step for step, _ in found["train/reward_mean"]] == [1, 2, 3]
    assert [v for _, v in found["train/reward_mean"]] == [0.25, 0.5, 0.75]
    assert [v for _, v in found["train/gen_tokens_per_s"]] == [1000.0, 1500.0, 1200.0]
    assert [v for _, v in found["train/staleness_mean"]] == [0.0, 0.75, 1.0]
    assert [v for _, v in found["train/loss"]] == pytest.approx([0.5, 0.4, 0.3])
    assert found["train/episodes/tool_s_sum"] == [(1, 1.5), (2, 1.5), (3, 1.5)]
    assert "train/kl" not in found  # NaN: no figure
    assert not any("staleness/" in tag or tag == "train/step" for tag in found)


def test_wandb_gets_the_same_figures(monkeypatch, tmp_path):
    calls = []

    class Run:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.__spec__ = types.SimpleNamespace(name="wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with logging_to(ScalarLog(wandb="my-project", run_name="run-tag", config={"seed": 0}, wandb_dir=tmp_path)):
        with Progress(3) as progress:
            progress.update(RECORDS[0])
    assert calls[0] == ("init", {"project": "my-project", "name": "run-tag", "config": {"seed": 0},
                                 "dir": str(tmp_path)})  # fmt: skip
    assert calls[1][:2] == ("log", 1) and calls[1][2]["train/reward_mean"] == 0.25
    assert calls[-1] == ("finish",)


@pytest.fixture
def started(monkeypatch):
    """Training that runs two steps' worth of progress (as the sink would feed it), then stops as Ctrl-C."""
    import reference.train

    runs = []

    def fake_train(cfg, out, progress=True, resume=False):
        runs.append(out)
        with Progress(cfg.policy.num_steps, enabled=progress) as bar:
            for r in RECORDS[:2]:
                bar.update(r)
        raise KeyboardInterrupt

    monkeypatch.setattr(reference.train, "train", fake_train)
    return runs


def test_the_train_command_logs_to_tensorboard(tmp_path, capsys, started):
    board = tmp_path / "tb"
    assert main(["train", "--out", str(tmp_path / "run"), "--steps", "2", "--tensorboard", str(board)]) == 130
    assert [v for _, v in read_scalars(board)["train/reward_mean"]] == [0.25, 0.5]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("config: ") and err[0].endswith("reference/configs/train.yaml")
    assert err[2:4] == ["step 1/2  reward 0.250  1,000 gen tok/s  staleness 0.00  2 s",
                        "step 2/2  reward 0.500  1,500 gen tok/s  staleness 0.75  4 s"]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--wandb", "proj"], "error: --wandb needs the wandb package: pip install wandb"),
        (
            ["--tensorboard", "tb"],
            "error: --tensorboard needs the tensorboardX package: pip install tensorboardX "
            "(or pip install -e '.[tensorboard]')",
        ),  # fmt: skip
    ],
)
def test_a_logger_whose_package_is_missing_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch,
                                                                              started, argv, line):  # fmt: skip
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, whether or not it is installed
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--out", "run", *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert started == [] and list(tmp_path.iterdir()) == []
