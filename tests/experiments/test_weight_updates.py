"""The weight-update experiment runs end to end on the real runtime (a short smoke run)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_weight_update_strategies_smoke(tmp_path):
    from experiments.weight_updates import main

    # Six seconds: long enough for every strategy to update and finish turns on a busy 2-core machine.
    main(["--agents", "4", "--seconds", "6", "--interval-s", "1", "--max-tokens", "32", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "weight_updates.json").read_text())
    by = {r["strategy"]: r for r in data["results"]}
    assert set(by) == {"partial", "drain", "restart"}
    assert all(r["updates"] >= 1 and r["turns"] > 0 for r in by.values())
    assert by["partial"]["wasted_share"] == pytest.approx(0, abs=1e-9)
    assert by["drain"]["wasted_share"] == pytest.approx(0, abs=1e-9) and by["drain"]["stale_token_share"] == 0
    for name in ("weight_updates.png", "weight_updates_timeline.png"):
        assert (tmp_path / name).stat().st_size > 0
    trace = json.loads((tmp_path / "weight_updates_trace.json").read_text())
    assert {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"} >= set(by)


def test_unknown_strategy_is_refused(capsys):
    from experiments.weight_updates import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--strategies", "partial,teleport"])
    assert "teleport" in capsys.readouterr().err
