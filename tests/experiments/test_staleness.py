"""experiments/staleness.py: steps and seconds to a target reward from runs' metrics, the picture, bad arguments."""

from __future__ import annotations

import json

import pytest

from experiments import staleness as st


def _run(rewards: list[float], step_s: float, lag: float) -> dict:
    steps = [{"step": i, "time_s": (i + 1) * step_s, "reward": r} for i, r in enumerate(rewards)]
    return {"steps": steps, "mean_lag": lag, "held_out_end": rewards[-1], "wall_s": len(rewards) * step_s}


def test_reach_is_the_first_step_whose_windowed_mean_gets_there():
    run = _run([0.0, 0.5, 0.9, 0.9, 0.9, 0.2], 2.0, 0.0)
    assert st.reach(run["steps"], 0.8, 1) == (3, 6.0)  # step index 2, the third step
    assert st.reach(run["steps"], 0.8, 3) == (5, 10.0)  # 0.9, 0.9, 0.9
    assert st.reach(run["steps"], 0.95, 1) == (None, None)


def test_the_summary_counts_seeds_that_never_get_there_apart(tmp_path):
    colocated = {"0": _run([0.2, 0.9, 0.9, 0.9, 0.9, 0.9], 2.0, 0.0), "1": _run([0.1] * 6, 2.0, 0.0)}
    async_b2 = {
        "0": _run([0.2, 0.4, 0.9, 0.9, 0.9, 0.9], 1.0, 1.4),
        "1": _run([0.2, 0.4, 0.5, 0.9, 0.9, 0.9], 1.0, 1.5),
    }
    data = {"seeds": [0, 1], "steps": 6, "runs": {"colocated": colocated, "async b2": async_b2}}
    rows = {r["setting"]: r for r in st.summarise(data, 0.8, 1)}
    assert rows["colocated"]["reached"] == 1 and rows["colocated"]["steps_to_target"] == 2
    assert rows["async b2"]["reached"] == 2 and rows["async b2"]["steps_to_target"] == 3.5
    assert rows["async b2"]["seconds_to_target"] == 3.5 and rows["async b2"]["mean_lag"] == pytest.approx(1.45)
    st.plot(data, tmp_path / "s.png", 0.8)
    assert (tmp_path / "s.png").stat().st_size > 10_000


def test_replot_redraws_from_saved_data_and_bad_arguments_are_usage_errors(tmp_path, capsys):
    data = {"seeds": [0], "steps": 6, "runs": {"tag": {"0": _run([0.5, 0.9, 0.9, 0.9, 0.9, 0.9], 1.0, 0.8)}}}
    (tmp_path / "staleness.json").write_text(json.dumps(data))
    assert st.main(["--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "staleness.png").is_file() and "tag" in capsys.readouterr().out
    for argv in (["--seeds", "a,b"], ["--target", "1.5"], ["--steps", "2", "--window", "5"]):
        with pytest.raises(SystemExit) as info:
            st.main([*argv, "--out", str(tmp_path / "x")])
        assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        st.main(["--replot", "--out", str(tmp_path / "empty")])
    assert info.value.code == 2
