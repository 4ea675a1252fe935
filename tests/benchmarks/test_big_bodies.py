"""`python -m benchmarks.big_bodies` runs end to end on a small case and prints its three figures."""

from __future__ import annotations

import pytest

from benchmarks import big_bodies


def test_big_bodies_prints_statuses_health_and_memory(capsys):
    assert big_bodies.main(["--bodies", "2", "--mib", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 bodies of 1 MiB at once: statuses [400, 400]" in out
    assert "/health during them: 200" in out and "MB at the peak" in out


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        big_bodies.main(["--mib", "9"])
    assert e.value.code == 2 and "--mib in (0, 8]" in capsys.readouterr().err
