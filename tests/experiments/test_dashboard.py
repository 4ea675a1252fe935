"""experiments/dashboard.py: TensorBoard's smoothing, the saved scalars and the redrawn picture, bad arguments."""

from __future__ import annotations

import csv
import json

import pytest

from experiments import dashboard as db


def test_smoothing_is_tensorboards_debiased_moving_average():
    assert db.smooth([1.0, 0.0, 1.0], 0.6) == pytest.approx([1.0, 0.24 / 0.64, 0.544 / 0.784])
    assert db.smooth([5.0] * 10) == pytest.approx([5.0] * 10)  # debiased: a constant stays itself from step 1


def test_replot_draws_every_card_from_the_saved_scalars(tmp_path):
    scalars = {"train/reward_mean": [[1, 0.1], [2, 0.3]], "eval/reward_mean": [[0, 0.05], [2, 0.2]]}
    data = {"command": "python -m reference train ...", "steps": 2, "seed": 0, "wall_s": 3.0, "scalars": scalars}
    (tmp_path / "scalars.json").write_text(json.dumps(data))
    assert db.main(["--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "dashboard.png").read_bytes().startswith(b"\x89PNG")  # the cards not logged say so


def test_the_csv_has_a_row_a_value(tmp_path):
    db.write_csv({"train/loss": [(1, 0.5), (2, 0.25)], "eval/exact_match": [(0, 0.0)]}, tmp_path / "s.csv")
    with (tmp_path / "s.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows == [
        ["tag", "step", "value"],
        ["eval/exact_match", "0", "0.0"],
        ["train/loss", "1", "0.5"],
        ["train/loss", "2", "0.25"],
    ]


def test_replot_without_data_and_bad_steps_are_one_usage_line(tmp_path, capsys):
    for argv in (["--replot", "--out", str(tmp_path)], ["--steps", "0", "--out", str(tmp_path)]):
        with pytest.raises(SystemExit) as exit_:
            db.main(argv)
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--replot needs" in err and "--steps must be >= 1, got 0" in err
