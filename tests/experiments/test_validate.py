"""The sim-versus-runtime validation: its fits recover what they should, its config mirrors the runtime's,
and a short run goes end to end."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys

import pytest
import yaml

from experiments import comparison, cpu_sampler, in_run, validate_setup, validate_swe
from experiments import runtime_parts as parts
from experiments import trainer_parts as tparts
from experiments import validate as v


def _device(tmp_path) -> dict:
    device = {**parts.measure_device(repeats=2), "peak_tflops": 0.1, "hbm_bandwidth_gb_s": 20.0}
    (tmp_path / "cpu-core.yaml").write_text(yaml.safe_dump(device))
    return device


def _mirror(tmp_path, costs: dict | None = None):
    """The simulator's mirror of a 3-step runtime run, with an empty profile of the runtime's model."""
    from sim.profile import DeviceInfo, ModelProfile, Profile, write_profile

    rt, task, model_config = validate_setup.runtime_setup(3)
    (tmp_path / "model").mkdir()
    model_config.to_json_file(str(tmp_path / "model" / "config.json"))
    _device(tmp_path)
    name = str((tmp_path / "model" / "config.json").resolve())
    write_profile(Profile(1, DeviceInfo("cpu", "float32", spec=parts.DEVICE_NAME), (ModelProfile(name),)),
                  tmp_path / "profile.yaml")  # fmt: skip
    config = validate_setup.sim_config_dict(rt, task, 3, tmp_path, costs or {})
    (tmp_path / "sim_config.yaml").write_text(yaml.safe_dump(config))
    return rt, task, config


def test_the_simulator_mirrors_the_runtime_config(tmp_path):
    from sim.config import load_config

    rt, task, _ = _mirror(tmp_path)
    cfg = load_config(tmp_path / "sim_config.yaml")
    assert cfg.num_steps == 3 and cfg.cluster.num_gpus == rt.resources.count
    assert cfg.pools.train_fraction == rt.resources.train_fraction
    assert cfg.rollout.max_num_seqs == rt.engine.max_batch and cfg.rollout.tensor_parallel == 1
    assert cfg.workload.prompts_per_step == rt.rollout.prompts_per_step
    assert cfg.workload.group_size == rt.rollout.group_size and cfg.workload.shared_response
    assert cfg.workload.response_tokens.max == task.simulator_workload()["response_tokens"]["max"]
    assert not cfg.train.recompute_logprobs and cfg.train.activation_recompute == "none"
    assert cfg.policy.max_staleness == rt.policy.max_staleness


def test_the_trainer_fit_recovers_known_costs(tmp_path):
    """Points made by the simulator's own train step (micro-batches padded as the runtime's trainer pads them)
    at known efficiencies and overhead give them back."""
    from core import specs
    from sim import train_layout
    from sim.calibration import measured_setup
    from sim.config import load_config

    _, task, _ = _mirror(tmp_path)
    cfg = load_config(tmp_path / "sim_config.yaml")
    model, device = specs.model(cfg.model), specs.device(cfg.cluster.device)
    assert cfg.train.micro_batch_sequences == 64  # the mirror pads as the runtime's trainer does
    truth = measured_setup(cfg, train_mfu=0.3, train_attention_mfu=0.1, train_step_overhead_s=0.05)
    rng = random.Random(0)
    batches = [[sum(pair) for pair in tparts.draw_batch_lengths(task, n, 16, rng)] for n in (64, 128, 256) * 2]
    points = [
        {"seq_lens": lens, "seconds": train_layout.step(truth, model, device, lens, 1).total_s} for lens in batches
    ]
    fitted = tparts.fit_trainer(cfg, model, device, points)
    assert fitted["train_mfu"] == pytest.approx(0.3, rel=1e-6)
    assert fitted["train_attention_mfu"] == pytest.approx(0.1, rel=1e-6)
    assert fitted["train_step_overhead_s"] == pytest.approx(0.05, rel=1e-6)
    # Attention at the matmuls' efficiency comes back as that efficiency; a term the points leave at or below 0
    # is dropped (here the overhead).
    same = measured_setup(cfg, train_mfu=0.3, train_attention_mfu=None, train_step_overhead_s=0.0)
    flat = [{"seq_lens": p["seq_lens"], "seconds": train_layout.step(same, model, device, p["seq_lens"], 1).total_s}
            for p in points]  # fmt: skip
    again = tparts.fit_trainer(cfg, model, device, flat)
    assert again["train_mfu"] == pytest.approx(0.3, rel=1e-3)
    assert again["train_attention_mfu"] in (None, pytest.approx(0.3, rel=1e-3))
    assert again["train_step_overhead_s"] == pytest.approx(0.0, abs=1e-6)
    # Matmuls at the cap (the fastest a fit may give them) come back at it, with the other terms.
    fast = measured_setup(cfg, train_mfu=0.75, train_attention_mfu=0.05, train_step_overhead_s=0.1)
    capped = [{"seq_lens": p["seq_lens"], "seconds": train_layout.step(fast, model, device, p["seq_lens"], 1).total_s}
              for p in points]  # fmt: skip
    assert tparts.fit_trainer(cfg, model, device, capped) == pytest.approx(
        {"train_mfu": 0.75, "train_attention_mfu": 0.05, "train_step_overhead_s": 0.1}, rel=1e-6
    )
    # Data-parallel steps made with a known overhead of their own beyond the one-rank constants give it back,
    # and a layout with no data-parallel step measured gives none.
    dp_truth = measured_setup(cfg, train_mfu=0.3, train_attention_mfu=0.1, train_step_overhead_s=0.05,
                              train_dp_overhead_s=0.2)  # fmt: skip
    dp_points = []
    for lens in batches:  # whole groups to each rank, as the runtime shards them
        groups = [lens[i : i + 16] for i in range(0, len(lens), 16)]
        shards = [sum(groups[rank::2], []) for rank in (0, 1)]
        seconds = train_layout.step(dp_truth, model, device, shards[0] + shards[1], 2).total_s
        dp_points.append({"shards": shards, "seconds": seconds})
    assert tparts.fit_data_parallel(cfg, model, device, dp_points, fitted) == pytest.approx(0.2, rel=1e-6)
    assert tparts.fit_data_parallel(cfg, model, device, [], fitted) is None
    one = train_layout.step(dp_truth, model, device, batches[0], 1)
    assert one.overhead_s == pytest.approx(0.05)  # one rank: no data-parallel step


def test_batches_of_one_length_pin_the_trainer_fit_on_a_noisy_machine(tmp_path):
    """With a tenth of noise on each step's seconds (a shared machine), the workload's batches alone, whose
    lengths all follow one distribution, barely tell attention from the matmuls; batches of one length each
    (`shape_lengths`, as `measure_trainer` adds them) at one token count pin both, over many noise draws."""
    from core import specs
    from sim import train_layout
    from sim.calibration import measured_setup
    from sim.config import load_config

    _, task, _ = _mirror(tmp_path)
    context = validate_setup.runtime_setup(3)[2].max_position_embeddings
    cfg = load_config(tmp_path / "sim_config.yaml")
    model, device = specs.model(cfg.model), specs.device(cfg.cluster.device)
    truth = measured_setup(cfg, train_mfu=0.3, train_attention_mfu=0.1, train_step_overhead_s=0.05)
    shapes = tparts.shape_lengths(context, 8192)
    assert [length for _, length in shapes] == sorted({length for _, length in shapes})  # distinct, short to long
    assert all(abs(n * length - 8192) <= length for n, length in shapes)  # one token count
    rng = random.Random(0)
    workload = [[sum(pair) for pair in tparts.draw_batch_lengths(task, n, 16, rng)] for n in (64, 128, 256) * 3]
    spread = {}
    one_length = [tparts.padded_lengths(k, n, 64) for k, n in shapes]
    for label, batches in (("workload", workload), ("with shapes", workload + one_length)):
        attention = []
        for seed in range(10):
            noise = random.Random(seed)
            points = [{"seq_lens": b, "seconds": train_layout.step(truth, model, device, b, 1).total_s
                       * (1 + noise.uniform(-0.1, 0.1))} for b in batches]  # fmt: skip
            fitted = tparts.fit_trainer(cfg, model, device, points)
            attention.append(fitted["train_attention_mfu"] or fitted["train_mfu"])
        spread[label] = max(attention) / min(attention)
        if label == "with shapes":
            assert all(0.075 <= a <= 0.16 for a in attention), attention
    assert spread["with shapes"] < spread["workload"] / 2, spread


@pytest.mark.parametrize(
    "n, length, micro_batch", [(248, 33, 64), (61, 135, 64), (20, 405, 64), (2, 8, 64), (9, 40, 4)]
)
def test_one_length_batches_pad_every_micro_batch_of_the_trainer(n, length, micro_batch):
    """The trainer (reference/trainer/trainer.py) sorts a batch by length and slices it into near-equal
    micro-batches; a micro-batch with nothing padded runs without an attention mask, faster than a run's."""
    lengths = tparts.padded_lengths(n, length, micro_batch)
    assert len(lengths) == n and max(lengths) == length and min(lengths) >= length - 2 * (-(-n // micro_batch))
    ordered, count = sorted(lengths), -(-n // micro_batch)
    slices = [ordered[i * n // count : (i + 1) * n // count] for i in range(count)]
    assert all(len(piece) <= micro_batch and min(piece) < max(piece) for piece in slices), slices


def _summary(tokens_s: float, step_s: float, bubble: float, util: dict, steps: int = 4) -> dict:
    return {"token_throughput": tokens_s, "step_time_s": {"mean": step_s}, "bubble_fraction": bubble,
            "utilisation": util, "device_seconds": {"total": 10.0}, "num_steps": steps}  # fmt: skip


def test_batches_are_drawn_in_groups_that_share_a_length():
    _, task, _ = validate_setup.runtime_setup(3)
    lengths = tparts.draw_batch_lengths(task, 40, 16, random.Random(0))
    assert len(lengths) == 40 and len(set(lengths[:16])) == 1 and len(set(lengths[16:32])) == 1
    assert len(set(lengths)) > 1  # the groups differ
    cap = task.simulator_workload()["response_tokens"]["max"]
    assert all(1 <= r <= cap for _, r in lengths)


def test_compare_gives_relative_errors_points_and_ratios():
    measured = {"colocated": _summary(1000, 2.0, 0.1, {"rollout": 0.5, "train": 0.4, "idle": 0.1}),
                "tag": _summary(1500, 1.0, 0.2, {"rollout": 0.6, "train": 0.2, "sync": 0.0, "idle": 0.2})}  # fmt: skip
    predicted = {"colocated": _summary(2000, 1.0, 0.05, {"rollout": 0.5, "train": 0.5}),
                 "tag": _summary(1500, 1.5, 0.25, {"rollout": 0.5, "train": 0.25, "idle": 0.25})}  # fmt: skip
    rows = comparison.compare(measured, predicted)
    assert rows["colocated"]["trained tok/s"]["error"] == pytest.approx(1.0)  # +100%
    assert rows["colocated"]["step (s)"]["error"] == pytest.approx(-0.5)
    assert rows["tag"]["bubble"]["error"] == pytest.approx(0.05) and rows["tag"]["bubble"]["error_kind"] == "points"
    assert rows["colocated"]["train dev-s/step"]["measured"] == pytest.approx(0.4 * 10 / 4)
    assert rows["tag"]["sync dev-s/step"]["predicted"] == 0.0 and math.isnan(rows["tag"]["sync dev-s/step"]["error"])
    assert rows["tag"]["ratio to colocated"] == {"measured": 1.5, "predicted": 0.75}
    text = comparison.table(rows)
    assert "+100%" in text and "+5.0 pt" in text and "0.75x" in text


def test_repeats_give_a_mean_with_its_range_and_the_orders_side_by_side():
    idle = {"rollout": 0.5, "train": 0.4, "idle": 0.1}
    colocated = [_summary(900, 2.0, 0.1, idle), _summary(1100, 2.2, 0.1, idle), _summary(1000, 1.8, 0.1, idle)]
    measured = {"colocated": colocated, "tag": [_summary(1400, 1.0, 0.2, idle), _summary(1600, 1.0, 0.2, idle)]}
    predicted = {"colocated": _summary(1100, 2.0, 0.1, idle), "tag": _summary(1000, 1.0, 0.2, idle)}
    rows = comparison.compare(measured, predicted)
    cell = rows["colocated"]["trained tok/s"]
    assert (cell["measured"], cell["low"], cell["high"], cell["runs"]) == (1000, 900, 1100, 3)
    assert cell["spread"] == pytest.approx(0.1) and cell["error"] == pytest.approx(0.1)
    assert rows["tag"]["trained tok/s"]["error"] == pytest.approx(1000 / 1500 - 1)
    agree = comparison.agreement(rows)
    assert agree["order_measured"] == ["tag", "colocated"] and agree["order_predicted"] == ["colocated", "tag"]
    assert not agree["same_order"]
    assert agree["trained tok/s"]["max_abs_error"] == pytest.approx(1 / 3)
    assert agree["trained tok/s"]["largest_spread"] == pytest.approx(0.1)
    assert "900-1,100 (3)" in comparison.table(rows) and "a different order" in comparison.agreement_text(agree)
    assert "rounds" not in agree  # one prediction for every round: no round's own error


def test_a_prediction_a_round_gives_each_rounds_error_and_order():
    idle = {"rollout": 0.5, "train": 0.4, "idle": 0.1}
    measured = {"colocated": [_summary(900, 2.0, 0.1, idle), _summary(1100, 2.0, 0.1, idle)],
                "tag": [_summary(1000, 1.0, 0.2, idle), _summary(1000, 1.0, 0.2, idle)]}  # fmt: skip
    predicted = {"colocated": [_summary(990, 2.0, 0.1, idle), _summary(1100, 2.2, 0.1, idle)],
                 "tag": [_summary(1050, 1.0, 0.2, idle), _summary(1200, 1.0, 0.2, idle)]}  # fmt: skip
    rows = comparison.compare(measured, predicted)
    cell = rows["colocated"]["trained tok/s"]
    assert cell["predicted"] == pytest.approx(1045) and cell["error"] == pytest.approx(0.045)
    assert cell["round_errors"] == pytest.approx([0.1, 0.0])
    agree = comparison.agreement(rows)
    first, second = agree["rounds"]
    assert first["trained tok/s"]["mean_abs_error"] == pytest.approx((0.1 + 0.05) / 2)
    assert first["same_order"] and first["order_measured"] == ["tag", "colocated"]
    assert second["trained tok/s"]["max_abs_error"] == pytest.approx(0.2)
    assert not second["same_order"] and second["order_predicted"] == ["tag", "colocated"]
    assert second["step (s)"]["max_abs_error"] == pytest.approx(0.1)
    text = comparison.agreement_text(agree)
    assert "round 1 (its own parts and runs)" in text and "round 2" in text and "order tag > colocated" in text


def test_only_pairs_the_runtimes_runs_tell_apart_have_an_order_to_agree_with():
    idle = {"rollout": 0.5, "train": 0.4, "idle": 0.1}
    measured = {"colocated": [_summary(900, 2.0, 0.1, idle), _summary(1100, 2.0, 0.1, idle)],  # 900-1,100
                "tag": [_summary(1050, 1.0, 0.2, idle), _summary(1250, 1.0, 0.2, idle)],  # overlaps colocated
                "async": [_summary(1300, 1.0, 0.2, idle), _summary(1400, 1.0, 0.2, idle)]}  # above both  # fmt: skip
    predicted = {"colocated": _summary(1200, 2.0, 0.1, idle), "tag": _summary(1000, 1.0, 0.2, idle),
                 "async": _summary(1100, 1.0, 0.2, idle)}  # fmt: skip
    agree = comparison.agreement(comparison.compare(measured, predicted))
    pairs = {(p["faster"], p["slower"]): p["same"] for p in agree["separated_pairs"]}
    assert pairs == {("async", "colocated"): False, ("async", "tag"): True}  # tag and colocated overlap
    text = comparison.agreement_text(agree)
    assert "tell apart (one's slowest run above the other's fastest): 2 of 3" in text
    assert "orders 1 of them the same (not: async > colocated)" in text


def test_the_swe_mirror_runs_the_rounds_measured_workload_in_the_runtimes_slots(tmp_path):
    """--workload swe: the recipe's run (no evaluations), its trainer's epochs and micro-batches, its rollout
    manager's slots, and the round's measured episode lengths and sandbox times over the task's own."""
    from sim.config import load_config
    from sim.workload import Workload

    rt, task, model_config = validate_setup.runtime_setup(3, "swe")
    try:
        assert rt.task.name == "swe" and not rt.run.evaluate and rt.policy.num_steps == 3
        assert model_config.max_position_embeddings == task.config.context_tokens
        measured = {"kind": "swe", "turns": {"median": 6.0, "sigma": 0.3, "min": 2, "max": 10},
                    "response_tokens": {"median": 90.0, "sigma": 0.4, "min": 4, "max": 512},
                    "tool_latency_s": {"median": 0.2, "sigma": 0.5, "min": 0.05, "max": 3.0},
                    "test_run_s": {"median": 1.5, "sigma": 0.2, "min": 0.9, "max": 4.0},
                    "episodes": 64, "exit_reasons": {"submitted": 40, "turn_limit": 24}}  # fmt: skip
        config = validate_setup.sim_config_dict(rt, task, 3, tmp_path, {}, measured)
        w = config["workload"]
        assert "episodes" not in w and "exit_reasons" not in w  # what the fit reports beside the simulator's keys
        assert w["turns"] == measured["turns"] and w["test_run_s"] == measured["test_run_s"]
        assert w["prompt_tokens"] == task.simulator_workload()["prompt_tokens"]  # not measured: the task's own
        assert w["prefix_cache_hit"] == 1.0 and w["max_context_tokens"] == task.config.context_tokens
        assert config["rollout"]["max_concurrency"] == rt.rollout.max_concurrency == 32
        assert config["train"]["ppo_epochs"] == 2 and config["train"]["micro_batch_sequences"] == 1
        assert config["policy"]["drain"] is True
        # the simulator reads it (the files it names aside)
        (tmp_path / "c.yaml").write_text(yaml.safe_dump({k: config[k] for k in ("workload", "rollout", "train")}))
        cfg = load_config(tmp_path / "c.yaml")
        assert cfg.rollout.max_concurrency == 32 and cfg.train.ppo_epochs == 2
        group = Workload(cfg.workload, 0).new_group()
        assert len(group) == 4 and all(2 <= len(s.turns) <= 10 for s in group)
        # the trainer's part draws whole episodes, as the trainer gets them
        lengths = tparts.draw_batch_lengths(task, 8, 4, random.Random(0))
        assert len(lengths) == 8 and all(p > 500 and r > 0 for p, r in lengths)
        context, generated = validate_setup.mean_lengths(task)
        assert context > 700 and 0 < generated < context
    finally:
        v._close(task)


def test_a_rounds_swe_workload_is_its_runs_episodes_with_the_sandboxes_measured_alone(tmp_path):
    from reference.manager.store import TrajectoryStore

    for policy, prompt in (("tag", 700), ("async", 900)):
        with TrajectoryStore(tmp_path / "runtime" / policy / "trajectories.sqlite") as store:
            store.append(f"{policy}-e0", "a", None, 0, [7] * prompt, [5] * 40, [-0.1] * 40, [0] * 40, "stop", "x")
            store.append(f"{policy}-e0", "b", "a", prompt + 40, [7] * 25, [5] * 60, [-0.1] * 60, [0] * 60, "stop", "x")
    sandboxes = {"tool_latency_s": {"median": 0.05, "sigma": 1.0, "min": 0.01, "max": 0.9},
                 "test_run_s": {"median": 0.6, "sigma": 0.1, "min": 0.5, "max": 0.8},
                 "start_s": {"median": 0.4, "sigma": 0.02, "min": 0.38, "max": 0.41}, "start_slots": 2,
                 "docker_cpu_s": 0.2}  # fmt: skip
    w = validate_swe.round_workload(tmp_path / "runtime", ("tag", "async"), 0, 1, sandboxes)
    assert w["episodes"] == 2 and w["turns"]["median"] == 2.0
    assert w["prompt_tokens"]["min"] == 700 and w["prompt_tokens"]["max"] == 900
    assert w["tool_output_tokens"]["median"] == 25.0
    assert w["sandbox_start_s"] == sandboxes["start_s"] and w["sandbox_start_slots"] == 2
    assert w["test_run_s"] == sandboxes["test_run_s"] and "docker_cpu_s" not in w
    assert "sandbox_busy_stretch" not in w  # a run made before the busy part: the simulator's default (1)
    busy = validate_swe.round_workload(tmp_path / "runtime", ("tag", "async"), 0, 1, {**sandboxes, "busy_stretch": 3.5})
    assert busy["sandbox_busy_stretch"] == 3.5 and "sandbox_cpu_cores" not in busy  # no episode seconds alone
    timed = {**sandboxes, "client_cpu_s": 0.1, "alone_s": [9.0, 8.0, 10.0], "busy_episodes": 4}
    cpu = validate_swe.round_workload(tmp_path / "runtime", ("tag", "async"), 0, 1, timed)["sandbox_cpu_cores"]
    assert cpu == pytest.approx((0.2 + 0.1) / (9.0 / 4))  # an episode's CPU-seconds over its seconds alone


def test_the_share_of_episodes_without_gradient_comes_from_the_runs_groups(tmp_path):
    from reference.manager.store import TrajectoryStore

    path = tmp_path / "trajectories.sqlite"
    with TrajectoryStore(path) as store:
        for sid, group, revision, rewards in (("g1-a", "g1", 0, [0, 0, 0, 0]),  # superseded by its revision 1
                                              ("g1-b", "g1", 1, [1, 0, 0, 0]),  # one above the mean
                                              ("g2", "g2", 0, [1, 1, 1, 1]),  # no signal at all
                                              ("g3", "g3", 0, [1, 1, 0, 0])):  # fmt: skip
            store.append(sid, "r", None, 0, [7] * 4, [5] * 2, [-0.1] * 2, [0] * 2, "stop", "x")
            episodes = [{"reward": r} for r in rewards]
            store.annotate(sid, {"meta": {"group": group, "revision": revision, "episodes": episodes}})
        store.annotate("other", {"meta": {"note": "not a group"}})
    # GRPO's negative half dropped (negative_weight 0): zero = g1's three, g2's four, g3's two; 9 of 12
    assert validate_swe.zero_advantage_share([path], 0.0, False) == pytest.approx(9 / 12)
    # with it kept (negative_weight 1): only the group with no signal
    assert validate_swe.zero_advantage_share([path], 1.0, False) == pytest.approx(4 / 12)
    assert validate_swe.zero_advantage_share([tmp_path / "empty.sqlite"], 0.0, False) is None


def test_the_sandboxes_in_the_runs_are_set_beside_the_part_alone(tmp_path):
    step = {"kind": "step", "episodes": {"exit_reasons": {"submitted": 3, "turn_limit": 1}, "tool_latency_s_sum": 8.0,
                                         "test_run_s_sum": 4.0, "sandbox_wait_s_sum": 2.0}}  # fmt: skip
    for r in (1, 2):
        run = tmp_path / "runtime" / f"tag-r{r}"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text(json.dumps(step) + "\n" + json.dumps({"kind": "held_out"}) + "\n")
    flat = {"sigma": 0.0, "min": 0.1, "max": 9.0}
    data = {"measured": {"tag": [{}, {}]},
            "parts": [{"workload": {"turns": {**flat, "median": n}}} for n in (5.0, 7.0)],
            "sandboxes": {"tool_latency_s": {**flat, "median": 0.1}, "test_run_s": {**flat, "median": 0.5},
                          "start_s": {**flat, "median": 0.4}}}  # fmt: skip
    rows = in_run.sandboxes_in_run(tmp_path, data)
    assert rows["tag"]["episodes"] == 8
    assert (rows["tag"]["tool_s"], rows["tag"]["test_s"], rows["tag"]["wait_s"]) == (2.0, 1.0, 0.5)
    alone = rows["tag"]["alone"]
    assert alone["tool_s"] == pytest.approx(0.5) and alone["test_s"] == 0.5 and alone["wait_s"] == 0.4  # 6 turns
    assert "tag 2.0 / 1.0 / 0.5" in in_run.sandboxes_in_run_text(rows)


def test_swe_arguments_are_one_line(capsys, tmp_path, monkeypatch):
    import swebench_env.docker_util as du

    assert v.main(["--warm", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "only with --workload swe" in capsys.readouterr().err
    assert v.main(["--workload", "swe", "--warm", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "not a directory (a checkpoint)" in capsys.readouterr().err
    monkeypatch.setattr(du, "docker_available", lambda: (False, "no Docker daemon is reachable at X"))
    assert v.main(["--workload", "swe", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --workload swe runs its episodes in Docker sandboxes: no Docker daemon") and \
        err.count("\n") == 1  # fmt: skip
    assert not (tmp_path / "o").exists()
    args = v.parse_args(["--workload", "swe"])
    assert args.steps == 3 and args.out == v.DEFAULT_OUTS["swe"]


def test_bad_arguments_are_one_line(capsys, tmp_path):
    assert v.main(["--policies", "tag,teleport", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (
        "error: --policies: unknown policy 'teleport'; valid choices: colocated, disaggregated, async, tag, "
        "streaming, all\n"
    )
    assert v.main(["--steps", "1", "--out", str(tmp_path / "o")]) == 2
    assert "--steps must be >= 2" in capsys.readouterr().err
    assert v.main(["--repeats", "0", "--out", str(tmp_path / "o")]) == 2
    assert "--repeats must be >= 1, got 0" in capsys.readouterr().err
    assert v.main(["--resimulate", "--out", str(tmp_path / "o")]) == 2
    assert "--resimulate: no validate.json in" in capsys.readouterr().err
    assert v.main(["--measure-busy-sandboxes", "--out", str(tmp_path / "o")]) == 2
    assert "--measure-busy-sandboxes: only with --resimulate" in capsys.readouterr().err
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "validate.json").write_text("{}")
    assert v.main(["--resimulate", "--measure-busy-sandboxes", "--out", str(tmp_path / "m")]) == 2
    assert "--measure-busy-sandboxes: only with --workload swe" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_short_validation_runs_end_to_end(tmp_path):
    argv = ["--quick", "--steps", "2", "--repeats", "2", "--policies", "colocated", "--out", str(tmp_path)]
    assert v.main(argv) == 0
    data = json.loads((tmp_path / "validate.json").read_text())
    row = data["comparison"]["colocated"]
    for label, *_ in comparison.METRICS:
        assert math.isfinite(row[label]["measured"]) and math.isfinite(row[label]["predicted"])
    assert row["trained tok/s"]["measured"] > 0 and row["trained tok/s"]["predicted"] > 0
    # Each round measured its own parts and was predicted from them.
    assert len(data["parts"]) == len(data["costs"]) == len(data["calibration"]) == 2
    assert len(data["predicted"]["colocated"]) == len(data["measured"]["colocated"]) == 2
    assert len(row["trained tok/s"]["round_errors"]) == 2 and len(data["agreement"]["rounds"]) == 2
    rounds = zip(data["costs"], data["calibration"], data["parts"], strict=True)
    for r, (costs, calibration, part) in enumerate(rounds):
        assert calibration["device"] == parts.DEVICE_NAME and calibration["points"]["decode"] >= 3
        assert 0 < costs["train_mfu"] <= 0.75 and costs["sync_fixed_s"] > 0
        # A sync through the trajectory manager, idle and while the engine generates: both timed, the idle
        # one's median is the fixed cost and the generating ones' excess the busy cost.
        in_place = part["sync_in_place"]
        assert in_place["idle_s"] and in_place["generating_s"], in_place
        assert costs["sync_fixed_s"] == in_place["sync_s"] and costs["sync_busy_s"] == in_place["sync_busy_s"] >= 0
        # The host's work a token and the data-parallel trainer were measured, and the mirror lets the host share
        # the resources' cores, placed as measured beside a busy trainer.
        assert costs["host_token_s"] > 0 and costs["train_dp_overhead_s"] >= 0
        assert part["host"]["rounds"]
        two = len(os.sched_getaffinity(0)) >= 2
        assert len(part["trainer"]["data_parallel"]) >= (1 if two else 0)
        if two:
            placement = part["host"]["placement"]
            assert 0 <= costs["host_train_placement"] == placement["host_train_placement"] <= 1, placement
        where = tmp_path / f"round-{r + 1}"
        mirror = yaml.safe_load((where / "sim_config.yaml").read_text())
        assert mirror["cluster"]["host_cores"] == validate_setup.host_cores(validate_setup.runtime_setup(2)[0]) >= 0
        assert mirror["costs"]["host_train_placement"] == costs["host_train_placement"]
        assert mirror["costs"]["sync_busy_s"] == costs["sync_busy_s"]
        for name in ("cpu-core.yaml", "profile.yaml", "sim_config.yaml", "model/config.json"):
            assert (where / name).stat().st_size > 0
    assert (tmp_path / "validate.png").stat().st_size > 0
    assert (tmp_path / "runtime" / "colocated-r2" / "summary.json").is_file()
    # Each runtime step's trainer against its round's part on that step's own sequences (read from the store).
    in_run = data["trainer_in_run"]["colocated"]
    assert in_run["steps"] == 4 and 0 < in_run["low"] <= in_run["median"] <= in_run["high"] < 20, in_run
    # The simulator side again from what was measured: the same prediction (nothing changed in between).
    assert v.main(["--resimulate", "--out", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "validate.json").read_text())
    assert again["predicted"] == data["predicted"] and again["measured"] == data["measured"]


def test_the_cpu_sampler_counts_a_run_and_the_processes_it_starts(tmp_path):
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6:\n    pass\n"
    code = f"import subprocess, sys\nchild = subprocess.Popen([sys.executable, '-c', {burn!r}])\n{burn}child.wait()\n"
    with subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True) as proc:
        sampler = cpu_sampler.CpuSampler(proc.pid, every_s=0.05)
        err = sampler.follow(proc)
    assert proc.returncode == 0, err
    result = sampler.result()
    assert result["cpu_s"]["driver"] >= 0.4 and result["cpu_s"]["other"] >= 0.4, result  # the run, its child
    assert result["cpu_s"]["engines"] == 0 and result["wall_s"] > 0.5
    assert "driver" in cpu_sampler.cpu_table({"colocated": result}, 2).splitlines()[0]
    # Against a timeline whose one rollout interval covers the whole run: every read counts as generating.
    from core.tags import Phase
    from core.timeline import Interval, Timeline

    first, last = sampler._series[0][0], sampler._series[-1][0]
    rollout = Interval("R00", ("rollout",), "rollout", Phase.ROLLOUT, 0.0, last - first + 1.0, 0, 0, 1)
    path = tmp_path / "timeline.json"
    Timeline([rollout], [], last - first + 1.0, {"clock_zero_epoch_s": first - 0.5}).save(path)
    busy = sampler.while_generating(path)
    assert busy["seconds"] == pytest.approx(last - first, abs=0.01)
    # Core-seconds, not cores: on a busy machine the burns take longer, each getting less than a core.
    assert busy["cores"]["driver"] * busy["seconds"] > 0.3, busy
    assert busy["cores"]["other"] * busy["seconds"] > 0.3, busy
    assert "cores busy while engines generate" in cpu_sampler.cpu_table(
        {"colocated": {**result, "while_generating": busy}}, 2
    )
    # Training on one resource the whole run, generating on the other from the middle: only the first half is
    # training alone.
    middle = (last - first) / 2 + 0.5
    train = Interval("R00", ("train",), "train", Phase.TRAIN, 0.0, last - first + 1.0, 0, 0, 1)
    late = Interval("R01", ("rollout",), "rollout", Phase.ROLLOUT, middle, last - first + 1.0, 0, 0, 1)
    Timeline([train, late], [], last - first + 1.0, {"clock_zero_epoch_s": first - 0.5}).save(path)
    alone = sampler.while_training_only(path)
    times = [t for t, _ in sampler._series]
    gap = max(b - a for a, b in zip(times, times[1:], strict=False))  # a read's span: how far a boundary can fall
    assert alone["seconds"] == pytest.approx((last - first) / 2, abs=gap + 1e-6), alone
    assert sampler.while_generating(path)["seconds"] == pytest.approx((last - first) / 2, abs=gap + 1e-6)
    table = cpu_sampler.cpu_table({"colocated": {**result, "while_training_only": alone}}, 2)
    assert "cores busy while only trainers work" in table and "while engines generate" not in table
    Timeline([rollout], [], last - first + 1.0, {}).save(path)  # no clock zero: nothing to align with
    assert sampler.while_generating(path) is None and sampler.while_training_only(path) is None


def test_the_simulators_padded_shards_are_the_runtimes_shards():
    """sim.train_layout.padded_shards gives each replica the groups the runtime's `_shard` gives its rank (the
    simulator cannot import the runtime; this pins the two together)."""
    from reference.control.executor import _shard
    from sim.train_layout import padded_shards

    _, task, model_config = validate_setup.runtime_setup(3)
    rng = random.Random(3)
    for n, ranks in ((64, 2), (128, 2), (96, 3)):
        batch = tparts.workload_batch(model_config, task, n, 16, rng)
        groups = [tparts._Group(g) for g in sorted({t.group_id for t in batch})]
        runtime = [sorted(len(t.token_ids) for t in shard) for shard in _shard(groups, batch, ranks)]
        lens = [len(t.token_ids) for t in batch]
        padded = padded_shards(lens, 16, ranks, 10**9)  # one micro-batch a replica: its lengths, padded to the longest
        assert [len(s) for s in padded] == [len(s) for s in runtime]
        assert [max(s) for s in padded] == [max(s) for s in runtime]
        assert [sum(s) for s in padded_shards(lens, 16, ranks, 1)] == [sum(s) for s in runtime]  # no padding


def test_the_placements_trainer_dying_is_a_clear_error_not_a_long_wait():
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    steps, trainer = ctx.Queue(), ctx.Process(target=sys.exit, args=(3,))
    trainer.start()
    with pytest.raises(RuntimeError, match=r"the placement's trainer process ended \(exit code 3\)"):
        parts._next_step(steps, trainer, deadline_s=120)
    trainer.join()
