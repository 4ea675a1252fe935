"""`python -m reference train`: every mistake is one line on stderr and exit code 2, before anything starts."""

from __future__ import annotations

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
            ["--task", "swe", "--set", "trainer.temperature=1.0"],
            "error: trainer.temperature 1.0 differs from rollout.temperature 0.7: the trainer scores tokens at the",
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

    swe = load_train_config(None, ["task.name=swe", "run.seed=5"])
    settings = trainer_settings(swe)
    assert (settings["temperature"], settings["seed"], settings["lr"]) == (0.7, 5, swe.trainer["lr"])
    assert TrainerConfig.from_dict(settings).temperature == 0.7
    same = load_train_config(None, ["rollout.temperature=0.5", "trainer.temperature=0.5"])  # set twice, in step
    assert trainer_settings(same)["temperature"] == 0.5
    assert "temperature" not in load_train_config(None).trainer  # the saved config does not repeat it


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
