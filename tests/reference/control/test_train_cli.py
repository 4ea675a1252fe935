"""`python -m reference train`: every mistake is one line on stderr and exit code 2, before anything starts."""

from __future__ import annotations

import os

import pytest

from reference.cli import main


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--task", "poetry"], "unknown task 'poetry'"),
        (["--policy", "fastest"], "unknown policy 'fastest'"),
        (["--model", "/nonexistent/ckpt"], "model.dir '/nonexistent/ckpt' is not a directory"),
        (["--backend", "tpu"], "unknown backend 'tpu'"),
        (["--backend", "vllm"], "backend 'vllm' needs NVIDIA GPUs"),
        (["--set", "resources.count=64"], "64 resources x 1 cores need 64 cores"),
        (["--set", "resources.count=1"], "policy 'tag' needs separate rollout and train resources"),
        (["--set", "rollout.group_size=1"], "rollout.group_size must be >= 2"),
        (["--set", "policy.max_staleness=-1"], "policy.max_staleness must be >= 0"),
        (["--set", "rollout.prompts_per_step=0"], "rollout.prompts_per_step must be >= 1"),
        (["--set", "run.eval_samples=0"], "run.eval_samples must be in [1, 64], got 0"),
        (["--set", "run.evaluate=maybe"], "config key 'run.evaluate' must be true or false, got 'maybe'"),
        (["--set", "run.held_out_samples=65"], "run.held_out_samples must be null or in [1, 64], got 65"),
        (["--set", "policy.drain=maybe"], "policy.drain"),
        (["--set", "trainer.epochs=0"], "error: trainer.epochs must be an integer >= 1, got 0"),
        (["--set", "engine.coalesce_s=5"], "engine.coalesce_s must be in [0, 1] seconds, got 5"),
        (["--set", "engine.coalesce_s=.nan"], "engine.coalesce_s must be in [0, 1] seconds, got nan"),
        (["--set", "trainer.lr=fast"], "error: trainer.lr must be a finite number, got 'fast'"),
        (["--set", "trainer.lr=-1"], "error: trainer.lr must be > 0, got -1"),
        (["--set", "trainer.negative_weight=2"], "error: trainer.negative_weight must be in [0, 1], got 2"),
        (["--set", "trainer.speed=2"], "unknown TrainerConfig field(s) ['speed']"),
        (["--set", "policy.window_batches=0"], "window_batches must be >= 1"),
        (["--set", "resources.train_fraction=1.0"], "train_fraction must be in (0, 1)"),
        (["--set", "task.options={digits: 99}"], "digits must be an integer in [1, 8]"),
        (["--set", "nope=1"], "unknown config key 'nope'"),
        (["--config", "/nonexistent.yaml"], "config file '/nonexistent.yaml' does not exist"),
        (["--ray-address", "127.0.0.1:1"], "cannot reach the Ray cluster at '127.0.0.1:1'"),
        (["--ray-address", "127.0.0.1:port"], "the port 'port' is not a number"),
        (["--ray-address", "http://x:1"], "expected host:port, ray://host:port or auto"),
        (["--task", "swe", "--set", "task.options={agent: claude}"], "unknown agent 'claude'"),
        (["--task", "swe", "--set", "task.options={max_turns: 0, sandbox: local}"], "max_turns must be an integer"),
        (["--task", "swe", "--set", "task.options={sandbox: vm}"], "unknown sandbox 'vm'"),
        (["--set", "warm_start={steps: 5, lr: -1}"], "error: warm_start.lr must be a finite number > 0"),
        (["--set", "warm_start={steps: 5, batch: 4}"], "warm_start: "),
        (["--set", "warm_start={steps: 5}"], "task 'math' has no demonstrations for a warm start"),
        (["--set", "trainer_parallel.param_dtype=fp8"], "param_dtype must be one of float32, bfloat16, got 'fp8'"),
        (["--set", "trainer_parallel.param_dtype=bfloat16"], "param_dtype bfloat16 needs trainer_parallel.fsdp=true"),
        (["--set", "trainer_parallel.fsdp=maybe"], "trainer_parallel.fsdp' must be true or false"),
        (["--set", "rollout.temperature=0"], "error: rollout.temperature 0 (greedy) cannot train: PPO's ratios need"),
        (["--set", "rollout.temperature=2.5"], "error: rollout.temperature must be in (0, 2], got 2.5"),
        (["--set", "rollout.temperature=.nan"], "error: rollout.temperature must be in (0, 2], got nan"),
        (
            ["--task", "swe", "--set", "trainer.temperature=1.0", "--set", "engine.logprobs_mode=processed"],
            "error: trainer.temperature 1.0 differs from rollout.temperature 0.7: the trainer scores tokens at the",
        ),
        (
            ["--task", "swe", "--set", "trainer.temperature=0.7"],
            "error: trainer.temperature 0.7 differs from engine.logprobs_mode raw's temperature 1.0: the trainer",
        ),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2(argv, needle, capsys, tmp_path):
    assert main(["train", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.count("\n") == 1, err  # one line, no traceback
    assert not (tmp_path / "out").exists()  # nothing was started or written


def test_an_unusable_out_folder_is_one_line(capsys, tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["train", "--out", str(target)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_more_data_parallel_shards_than_groups_is_refused(capsys, tmp_path):
    argv = ["train", "--policy", "colocated", "--set", "rollout.prompts_per_step=1", "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "cannot feed 2 data-parallel train resources" in capsys.readouterr().err


def _task_name(argv: list[str]) -> str:
    """The task a `train` command line resolves to (config and overrides only: nothing starts)."""
    from reference.cli import parser
    from reference.control.cli import _overrides
    from reference.control.config import load_train_config

    args = parser().parse_args(["train", *argv])
    return load_train_config(args.config, _overrides(args)).task.name


@pytest.mark.parametrize(
    "argv, task",
    [
        (["--compare"], "throughput"),  # --compare measures the runtime on the long-tailed workload
        (["--compare", "--task", "math"], "math"),
        (["--compare", "--set", "task.name=math"], "math"),
        ([], "math"),  # the config's task
        (["--task", "throughput"], "throughput"),
    ],
)
def test_compare_defaults_to_the_throughput_task(argv, task):
    assert _task_name(argv) == task


def test_compare_keeps_the_task_a_config_file_names(tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("task: {name: math}\n")
    assert _task_name(["--compare", "--config", str(config)]) == "math"


def test_config_files_layer_in_order_later_ones_winning(tmp_path):
    from reference.cli import parser
    from reference.control.cli import _overrides
    from reference.control.config import load_train_config

    base, top = tmp_path / "base.yaml", tmp_path / "top.yaml"
    base.write_text("task: {name: math}\npolicy: {num_steps: 7, max_staleness: 2}\n")
    top.write_text("policy: {num_steps: 9}\n")
    args = parser().parse_args(["train", "--config", str(base), "--config", str(top), "--set", "policy.drain=true"])
    cfg = load_train_config(args.config, _overrides(args))
    assert (cfg.task.name, cfg.policy.num_steps, cfg.policy.max_staleness, cfg.policy.drain) == ("math", 9, 2, True)
    assert _task_name(["--compare", "--config", str(top), "--config", str(base)]) == "math"  # either file names it


def test_the_mini_swe_agent_config_layers_over_the_swe_one():
    from reference.control.config import load_train_config

    cfg = load_train_config(["reference/configs/swe.yaml", "reference/configs/swe-mini.yaml"])
    swe = load_train_config("reference/configs/swe.yaml")
    assert (cfg.task.name, cfg.task.options["agent"], swe.task.options["agent"]) == ("swe", "mini-swe-agent", "builtin")
    assert cfg.task.options["context_tokens"] > swe.task.options["context_tokens"]
    assert cfg.trainer == swe.trainer and cfg.rollout == swe.rollout  # the same RL recipe
    assert cfg.policy == swe.policy
    assert cfg.warm_start["target_loss"] is None and swe.warm_start["target_loss"] > 0  # after a fixed warm start


def test_compare_writes_each_policys_resolved_config_before_it_runs(tmp_path, monkeypatch, capsys):
    """Each policy's folder exists and holds config.yaml (what --resume reads) before its run starts."""
    import reference.train

    seen = []

    def fake_train(cfg, out, progress=True, resume=False):
        seen.append((cfg.policy.name, (out / "config.yaml").is_file()))
        raise KeyboardInterrupt  # stop after the first policy: nothing else is under test here

    monkeypatch.setattr(reference.train, "train", fake_train)
    assert main(["train", "--compare", "--out", str(tmp_path / "cmp")]) == 130  # as after Ctrl-C
    assert seen == [("colocated", True)]


def test_the_trainer_gets_the_rollouts_temperature():
    """The engines store log-probs at rollout.temperature; the trainers are built to score at the same."""
    from reference.control.config import load_train_config, trainer_settings
    from reference.trainer.config import TrainerConfig

    swe = load_train_config(None, ["task.name=swe", "run.seed=5", "engine.logprobs_mode=processed"])
    settings = trainer_settings(swe)
    assert (settings["temperature"], settings["seed"], settings["lr"]) == (0.7, 5, swe.trainer["lr"])
    assert TrainerConfig.from_dict(settings).temperature == 0.7
    same = load_train_config(None, ["rollout.temperature=0.5", "trainer.temperature=0.5"])  # set twice, in step
    assert trainer_settings(same)["temperature"] == 0.5
    assert "temperature" not in load_train_config(None).trainer  # the saved config does not repeat it


def test_raw_logprobs_make_the_trainer_score_at_temperature_1():
    """engine.logprobs_mode raw: the engines record the temperature-1 model's log-probs, the trainers score at 1,
    the engines get the mode; the rollouts still sample at rollout.temperature."""
    from core.errors import UserError
    from core.policies import make_policy
    from reference.control.config import load_train_config, policy_config, trainer_settings
    from reference.control.layout import worker_specs

    raw = load_train_config(None, ["task.name=swe"])  # the SWE recipe's mode
    assert (trainer_settings(raw)["temperature"], raw.rollout.temperature) == (1.0, 0.7)
    policy = make_policy(raw.policy.name, policy_config(raw), raw.resources.count, raw.resources.train_fraction, 1)
    specs = worker_specs(raw, policy, "/m")
    assert {s.logprobs_mode for s in specs} == {"raw"}
    assert load_train_config(None, ["engine.logprobs_mode=raw", "trainer.temperature=1"]).engine.logprobs_mode == "raw"
    with pytest.raises(UserError, match=r"trainer.temperature 0.7 differs from engine.logprobs_mode raw's temperature"):
        load_train_config(None, ["task.name=swe", "engine.logprobs_mode=raw", "trainer.temperature=0.7"])
    with pytest.raises(UserError, match=r"unknown engine.logprobs_mode 'raw_logits'; choose one of processed, raw"):
        load_train_config(None, ["engine.logprobs_mode=raw_logits"])


def test_a_task_named_on_the_command_line_brings_its_recipe(tmp_path):
    from reference.control.config import DEFAULT_CONFIG, TASK_DEFAULTS, config_files, load_train_config

    swe = load_train_config(None, ["task.name=swe"])
    assert (swe.rollout.prompts_per_step, swe.rollout.group_size, swe.rollout.temperature) == (8, 4, 0.7)
    assert swe.task.options["sandbox"] == "docker" and swe.warm_start["steps"] > 0  # swe.yaml's, not math's
    mine = tmp_path / "mine.yaml"
    mine.write_text("rollout: {group_size: 6}\n")
    assert config_files([mine], ["task.name=swe"]) == [TASK_DEFAULTS["swe"], mine]
    assert load_train_config([mine], ["task.name=swe"]).rollout.group_size == 6  # the user's file still wins
    recipe = tmp_path / "recipe.yaml"  # a file that names its task is a recipe of its own over train.yaml
    recipe.write_text("task: {name: swe, options: {sandbox: local}}\n")
    assert config_files([recipe], []) == [recipe]
    assert load_train_config([recipe]).rollout.prompts_per_step == load_train_config(None).rollout.prompts_per_step
    assert config_files(None, ["task.name=math"]) == [] and DEFAULT_CONFIG.name == "train.yaml"


# ---- a Ray cluster already running where a local run would start its own ----


@pytest.fixture
def ray_home(tmp_path_factory, monkeypatch):
    """A Ray temporary directory of this test's own (where `ray start` records its cluster), no RAY_ADDRESS: what
    other Ray users on the machine have running does not leak in. Short: Ray's socket paths must fit 107 bytes."""
    import tempfile

    home = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", home)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield home
    import shutil

    shutil.rmtree(home, ignore_errors=True)


def _record_cluster(home: str, address: str) -> None:
    """What `ray start` (or a test's `ray.cluster_utils.Cluster`) leaves for a plain `ray.init()` to join."""
    folder = os.path.join(home, "ray")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "ray_current_cluster"), "w") as f:
        f.write(address)


def test_a_ray_cluster_left_running_is_one_line_naming_the_fix(ray_home, tmp_path, capsys):
    """Ray would join the recorded cluster and refuse the local run's sizes ("num_cpus ... must not be provided");
    the run says so before anything starts."""
    _record_cluster(ray_home, "10.1.2.3:6379")
    assert main(["train", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: a Ray cluster is already running on this machine (10.1.2.3:6379")
    assert "stop it with `ray stop`, or join it with --ray-address auto" in err
    assert not (tmp_path / "out").exists()


def test_ray_address_in_the_environment_is_named_with_its_fix(ray_home, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    assert main(["train", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: RAY_ADDRESS is set (10.1.2.3:6379), so Ray would join that cluster, but a run without --ray-address "
        "starts its own: unset RAY_ADDRESS, or pass --ray-address 10.1.2.3:6379\n"
    )


def test_joining_the_running_cluster_is_not_refused(ray_home):
    from reference.control.cli import validate
    from reference.control.config import load_train_config

    _record_cluster(ray_home, "10.1.2.3:6379")
    validate(load_train_config(None, ["run.ray_address=auto"]))  # no UserError: the cluster is the one asked for


def test_the_workers_refuse_before_ray_init_too(ray_home, monkeypatch):
    """A caller other than the CLI (an experiment) gets the same UserError from RayWorkers, before Ray starts."""
    import ray

    from core.errors import UserError
    from reference.ray.workers import RayWorkers

    _record_cluster(ray_home, "10.1.2.3:6379")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init was called"))
    with pytest.raises(UserError, match=r"a Ray cluster is already running on this machine \(10\.1\.2\.3:6379"):
        RayWorkers([])


@pytest.mark.slow
def test_a_real_cluster_left_running_is_refused_in_one_line(ray_home, tmp_path, capsys):
    """A real head node (as a test's `ray.cluster_utils.Cluster` leaves one), in this test's own Ray directory."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    address = cluster.address
    try:
        assert main(["train", "--out", str(tmp_path / "out")]) == 2
    finally:
        cluster.shutdown()
    err = capsys.readouterr().err
    assert err.startswith(f"error: a Ray cluster is already running on this machine ({address}")
    assert err.count("\n") == 1, err


def test_the_summary_names_each_throughput_and_warns_of_a_pool_idle_most_of_the_run(capsys):
    """Two rates with two names: every token of the trained sequences, and the generated ones only (the per-step
    line's); then a warning for the rollout pool, idle 60% of the run."""
    from reference.control.cli import print_warnings, table

    training = {"reward_first_step": 0.03, "reward_last_step": 0.54, "held_out_first": None, "held_out_last": None}
    summary = {
        "policy": "tag",
        "token_throughput": 3757.2,
        "generated_token_throughput": 1252.4,
        "step_time_s": {"mean": 0.85},
        "bubble_fraction": 0.3,
        "training": training,
        "staleness": {"histogram": {"0": 1, "1": 3}},
        "pool_utilisation": {"rollout": 0.4, "rollout+train": 0.9},
    }
    rows = {line[:24].strip(): line[24:].strip() for line in table([summary]).splitlines()}
    assert (rows["trained-sequence tok/s"], rows["gen tok/s"]) == ("3,757", "1,252")
    print_warnings([summary])
    assert capsys.readouterr().out == (
        "warning: under tag, the rollout pool was idle 60% of the time: more train resources or a looser staleness "
        "bound?\n"
    )
