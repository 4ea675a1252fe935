"""Configs that compose: several --config files in order, a workload kind's own defaults, the stderr note."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sim import search
from sim.cli import main
from sim.config import CONFIG_DIR, load_config

SMALL = ["--set", "cluster.num_gpus=32", "--set", "model=qwen3-8b", "--set", "rollout.tensor_parallel=2",
         "--set", "num_steps=1", "--set", "workload.prompts_per_step=4", "--quiet", "--no-picture"]  # fmt: skip
SWE = CONFIG_DIR / "swe.yaml"


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def saved(out: Path) -> dict:
    return yaml.safe_load((out / "config.yaml").read_text())


def test_two_config_files_compose_key_by_key_then_the_overrides(tmp_path):
    a = write(tmp_path / "a.yaml", {"num_steps": 3, "cluster": {"num_gpus": 32, "price_per_gpu_hour": 2.0},
                                    "rollout": {"max_num_seqs": 64}})  # fmt: skip
    b = write(tmp_path / "b.yaml", {"cluster": {"num_gpus": 16}, "rollout": {"tensor_parallel": 2}})
    cfg = load_config([a, b], ["num_steps=5"])
    assert cfg.cluster.num_gpus == 16  # the later file wins
    assert cfg.cluster.price_per_gpu_hour == 2.0  # the nested mapping merged, not replaced
    assert cfg.rollout.max_num_seqs == 64 and cfg.rollout.tensor_parallel == 2
    assert cfg.num_steps == 5  # --set last
    assert cfg.cluster.device == "h800"  # the default's, untouched
    assert load_config([b, a]).cluster.num_gpus == 32  # order matters


def test_both_files_apply_on_the_command_line(tmp_path, capsys, monkeypatch):
    """`python -m sim run --config A --config B`: the first file is not dropped (it used to be)."""
    monkeypatch.chdir(tmp_path)
    a = write(tmp_path / "a.yaml", {"pools": {"train_fraction": 0.25}})
    b = write(tmp_path / "b.yaml", {"rollout": {"max_num_seqs": 32}})
    assert main(["run", "--config", "a.yaml", "--config", "b.yaml", *SMALL, "--out", "o"]) == 0
    resolved = saved(tmp_path / "o")
    assert resolved["pools"]["train_fraction"] == 0.25 and resolved["rollout"]["max_num_seqs"] == 32
    default = CONFIG_DIR / "default.yaml"
    assert capsys.readouterr().err.splitlines()[0] == f"config: {default} + a.yaml + b.yaml"
    assert a.is_file() and b.is_file()


def test_the_note_names_the_files_merged_relative_to_the_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(CONFIG_DIR.parents[1])
    mine = write(tmp_path / "my.yaml", {"num_steps": 1})
    argv = ["--config", "sim/configs/swe.yaml", "--config", str(mine), *SMALL, "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"config: sim/configs/default.yaml + sim/configs/swe.yaml + {mine}"


def test_a_workload_kind_brings_its_own_defaults(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(CONFIG_DIR.parents[1])
    mine = write(tmp_path / "my.yaml", {"workload": {"kind": "swe"}})
    w = load_config(mine).workload
    shipped = load_config(SWE).workload
    assert w == shipped
    assert (w.response_tokens.median, w.prompts_per_step, w.group_size, w.turns.median) == (350, 64, 8, 20)
    assert load_config(None, ["workload.kind=swe"]).workload == shipped  # chosen by --set too
    assert load_config(None, ["workload.kind=math"]).workload == load_config().workload
    # the note says where the values came from
    assert main(["--config", str(mine), *SMALL, "--out", str(tmp_path / "o")]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        f"config: sim/configs/default.yaml + sim/configs/swe.yaml + {mine}"
    )
    assert saved(tmp_path / "o")["workload"]["response_tokens"]["median"] == 350


def test_a_user_value_wins_over_the_kind_default(tmp_path):
    mine = write(tmp_path / "my.yaml", {"workload": {"kind": "swe", "group_size": 4, "turns": {"median": 6}}})
    w = load_config(mine).workload
    assert w.group_size == 4 and w.turns.median == 6
    assert w.turns.max == 60 and w.response_tokens.median == 350  # the rest from swe.yaml
    # the kind in one file, the user's lengths in an earlier one: the user's still win
    early = write(tmp_path / "early.yaml", {"workload": {"prompts_per_step": 2}})
    late = write(tmp_path / "late.yaml", {"workload": {"kind": "swe"}})
    assert load_config([early, late]).workload.prompts_per_step == 2
    assert load_config(mine, ["workload.group_size=2"]).workload.group_size == 2


def test_shipped_configs_resolve_as_before(tmp_path):
    """swe.yaml named by the user is not applied a second time, and the resolved config saved next to a run's
    outputs loads back to the same config (its every key is set, so no kind default moves it)."""
    cfg = load_config(SWE)
    assert load_config([SWE, SWE]) == cfg
    assert main(["--config", str(SWE), *SMALL, "--out", str(tmp_path / "o")]) == 0
    assert load_config(tmp_path / "o" / "config.yaml") == load_config(SWE, SMALL[1:10:2])


@pytest.mark.parametrize("which", [0, 1])
def test_an_unknown_key_in_any_file_is_one_line_and_exit_2(tmp_path, capsys, which):
    files = [write(tmp_path / "a.yaml", {"num_steps": 1}), write(tmp_path / "b.yaml", {"workload": {"kind": "swe"}})]
    write(files[which], {"workload": {"knd": "swe"}})
    argv = ["--config", str(files[0]), "--config", str(files[1]), *SMALL, "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [f"error: unknown config key 'workload.knd'; valid keys here: {_keys()}"]
    assert not (tmp_path / "o").exists()


def _keys() -> str:
    from dataclasses import fields

    from sim.config import WorkloadConfig

    return ", ".join(f.name for f in fields(WorkloadConfig))


def test_the_search_composes_configs_too(tmp_path, capsys):
    a = write(tmp_path / "a.yaml", {"cluster": {"num_gpus": 32}, "model": "qwen3-8b"})
    b = write(tmp_path / "b.yaml", {"workload": {"kind": "swe", "prompts_per_step": 4}})
    argv = ["--config", str(a), "--config", str(b), "--policies", "tag", "--space", "rollout.tensor_parallel=4",
            "--space", "pools.train_fraction=0.5", "--space", "rollout.max_num_seqs=", "--jobs", "1",
            "--out", str(tmp_path / "s"), "--steps", "1", "--quiet", "--no-picture"]  # fmt: skip
    assert main(["search", *argv]) == 0
    assert capsys.readouterr().err.splitlines()[0].endswith(f"sim/configs/swe.yaml + {a} + {b}")
    record = json.loads((tmp_path / "s" / "search.json").read_text())
    assert record["config"] == [str(a), str(b)]
    best = load_config(tmp_path / "s" / "best.yaml")
    assert (best.cluster.num_gpus, best.workload.kind, best.workload.group_size) == (32, "swe", 8)
    assert search.parse_args(["--config", "x.yaml"]).config == ["x.yaml"]


def test_help_names_the_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "search" in out and "run" in out
