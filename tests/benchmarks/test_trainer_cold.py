"""`benchmarks.trainer_cold`: a small run prints every condition against a back-to-back step; bad sizes: one line."""

from __future__ import annotations

import pytest

from benchmarks.trainer_cold import main


def test_a_small_run_times_every_condition_against_a_step_right_after_a_step(capsys):
    import os

    cores = os.sched_getaffinity(0)
    main(["--batches", "1", "--sequences", "16"])
    assert os.sched_getaffinity(0) == cores  # the process gets its cores back
    out = capsys.readouterr().out
    lines = {line.split("  ")[0]: line.split() for line in out.splitlines()[2:]}
    assert set(lines) == {"after a step", "after 1.5 s idle", "after a publish", "after others' work"}, out
    assert lines["after a step"][-2:] == ["1.000", "1.000"]  # the baseline's own ratio
    for fields in lines.values():
        assert float(fields[-3]) > 0 and float(fields[-2]) > 0


def test_bad_sizes_name_themselves(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--batches", "0"])
    assert exit_.value.code == 2
    assert "--batches and --sequences must be at least 1, got 0 and 256" in capsys.readouterr().err
