"""Every recipe in examples/ runs as examples/README.md says, at a few steps and small sizes.

The configs name their files by paths relative to the repository root (as the README's commands run there), so
each test runs from it. The GPU recipe can only be checked by its dry run here (the plan it prints); the custom
task trains through the trainer in-process, and once end to end on Ray (`slow`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core import specs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MI300X = "examples/devices/mi300x.yaml"
MISTRAL = "examples/models/mistral-7b-instruct-v0.3/config.json"
REVERSE = "examples.reverse_task:ReverseTask"
FEW = ["--set", "num_steps=2", "--set", "workload.prompts_per_step=8", "--no-picture", "--quiet"]
QWEN3_8B = {  # Qwen/Qwen3-8B config.json, the keys core/specs/hf_config.py reads
    "model_type": "qwen3", "num_hidden_layers": 36, "hidden_size": 4096, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
    "max_position_embeddings": 40960, "tie_word_embeddings": False,
}  # fmt: skip


@pytest.fixture(autouse=True)
def at_the_root(monkeypatch):
    monkeypatch.chdir(ROOT)


# ---- recipes 1 and 2: the simulator on a device file and on a config.json ----


def test_the_device_file_reads_as_its_datasheet_says():
    d = specs.device(MI300X)
    assert (d.name, d.peak_tflops, d.hbm_gb, d.hbm_bandwidth_gb_s, d.gpus_per_node) == ("mi300x", 1307.4, 192, 5300, 8)
    assert d.nvlink_gb_s == pytest.approx(896 / 2 * 0.8)  # devices.yaml's rule: 80% of the bidirectional halved
    assert d.pcie_gb_s == 64.0


def test_the_model_config_reads_as_mistral_7b():
    m = specs.model(MISTRAL)
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.vocab) == (32, 4096, 32, 8, 128, 32768)
    assert not (m.qk_norm or m.qkv_bias or m.tie_embeddings or m.is_moe)
    assert round(m.params / 1e9, 2) == 7.25  # Mistral 7B v0.3's 7.25 B parameters
    assert specs.model(str(Path(MISTRAL).parent)) == m  # the folder reads the same


@pytest.mark.parametrize(
    "config, device, model",
    [("sim-mi300x.yaml", MI300X, "qwen3-32b"), ("sim-mistral-7b.yaml", "h100", MISTRAL)],
)
def test_each_sim_example_runs(tmp_path, capsys, config, device, model):
    from sim.cli import main

    out = tmp_path / "run"
    assert main(["--config", f"examples/{config}", "--policy", "tag", *FEW, "--out", str(out)]) == 0
    assert f"config: sim/configs/default.yaml + examples/{config}" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_steps"] == 2 and summary["token_throughput"] > 0
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert (resolved["cluster"]["device"], resolved["model"]) == (device, model)


def test_a_device_file_is_named_by_its_name_in_the_summary_and_the_pictures(tmp_path, capsys):
    """The header of the printed summary, the picture's title and the timeline's meta (which the compare picture's
    title and every caption read) say "mi300x", the file's `name`, not its path."""
    from core.metrics import summarize
    from core.timeline import Timeline
    from sim.cli import main
    from sim.config import load_config
    from sim.report import run_title

    out = tmp_path / "run"
    assert main(["--config", "examples/sim-mi300x.yaml", "--policy", "tag", *FEW, "--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "qwen3-32b | math | 64 x mi300x | 2 steps | seed 0"
    timeline = Timeline.load(out / "intervals.json")
    assert timeline.meta["device"] == "mi300x"
    title = run_title(summarize(timeline), load_config(out / "config.yaml"))
    assert title.startswith("tag: qwen3-32b, math, 64 x mi300x\n")
    assert "trained-sequence tok/s" in title and "idle" in title


def test_the_layout_search_runs_on_the_model_file_and_its_best_reruns(tmp_path, capsys):
    from sim.cli import main

    out = tmp_path / "search"
    grid = ["--space", "pools.train_fraction=0.5", "--space", "rollout.tensor_parallel=1,2",
            "--space", "rollout.max_num_seqs=256", "--policies", "colocated,tag"]  # fmt: skip
    argv = ["search", "--config", "examples/sim-mistral-7b.yaml", *grid, "--steps", "2", "--jobs", "1"]
    assert main([*argv, "--set", "workload.prompts_per_step=8", "--no-picture", "--quiet", "--out", str(out)]) == 0
    assert "4 candidates: 4 ran, 0 pruned" in capsys.readouterr().out
    found = json.loads((out / "search.json").read_text())
    assert found, "search.json is empty"
    best = yaml.safe_load((out / "best.yaml").read_text())
    assert best["model"] == MISTRAL and best["rollout"]["tensor_parallel"] in (1, 2)
    assert main(["--config", str(out / "best.yaml"), "--policy", "tag", *FEW, "--out", str(tmp_path / "re")]) == 0


# ---- recipe 3: a real Qwen3 checkpoint on GPUs, checked by its dry run ----


def test_the_gpu_recipe_plans_what_it_sets(tmp_path, capsys):
    from reference.cli import main

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B))  # all a dry run reads of a checkpoint
    argv = ["train", "--config", "examples/gpu-qwen3-math.yaml", "--model", str(tmp_path), "--dry-run"]
    assert main([*argv, "--ray-address", "10.0.0.1:6379"]) == 0
    out = capsys.readouterr().out
    assert "nothing was started" in out and "task math, policy tag, 200 steps of 64 prompts x 16 samples" in out
    assert "8.19 B parameters, 36 layers" in out
    assert "8 x 2 GPUs (h100: 80 GB) = 16 GPUs; the run joins the Ray cluster at 10.0.0.1:6379" in out
    assert "engines: 8, backend vllm, tensor parallel 2, max batch 256" in out
    assert "weights: each new version through Ray's object store in bfloat16, copied to each engine's node" in out
    assert "trainer: 4 train-capable resources, FSDP over 8 GPUs" in out
    assert "(fp32 weights, gradients and AdamW moments, sharded)" in out
    assert "bf16, recomputed a layer at a time" in out
    problems = [line for line in out.splitlines() if line.startswith("fits:")]
    assert problems == [  # the one thing that does not fit is the runtime's, not the recipe's
        "fits: no: the workers do not place GPUs yet: Ray actors ask for none, an engine starts with tensor "
        "parallel 1 and a trainer shard on CPU (control/worker.py)"
    ]
    assert "`fits: no: the workers do not place GPUs yet`" in (EXAMPLES / "gpu-qwen3-math.yaml").read_text()


# ---- recipe 4: a task of one's own ----


def test_the_custom_task_builds_by_its_class_path_and_grades():
    from reference.tasks import make_task

    task = make_task(REVERSE, digits=4)
    assert task.max_tokens == 4
    p = task.problem("3907")
    assert (p.prompt, p.answer) == ("3907>", "7093")
    assert task.grade(p, "7093").reward == 1.0 and task.grade(p, "7093").exact
    wrong = task.grade(p, "3907")
    assert wrong.reward == 0.0 and not wrong.exact
    assert task.grade(p, "70").reward == 0.5  # a missing digit is wrong
    assert all(len(task.tokenizer.encode(q.prompt)) == 5 for q in task.held_out())  # one token a character


def test_the_custom_task_keeps_its_held_out_problems_out_of_training():
    import random

    from reference.tasks import make_task

    task = make_task(REVERSE)
    held = {p.prompt for p in task.held_out()}
    assert len(held) == 100  # 3 digits: 200 of 1,000 strings held out, half of them listed
    assert held == {p.prompt for p in make_task(REVERSE).held_out()}  # the same in every process
    assert not held & {p.prompt for p in task.sample_train(random.Random(0), 500)}


@pytest.mark.parametrize(
    "name, message",
    [
        ("reverse", r"unknown task 'reverse'; choose one of \['math', 'swe', 'throughput'\], or give a task class"),
        ("examples.no_such_module:Task", r"cannot import 'examples.no_such_module' \(No module named"),
        ("examples.reverse_task:NoSuchClass", r"module 'examples.reverse_task' has no class 'NoSuchClass'"),
        ("examples.reverse_task:ReverseConfig.digits", "a task class is given as package.module:Class"),
        (":ReverseTask", "a task class is given as package.module:Class"),
    ],
)
def test_a_bad_task_path_is_one_clear_error(name, message):
    from reference.tasks import make_task

    with pytest.raises(ValueError, match=message):
        make_task(name)


def test_a_bad_task_path_or_option_on_the_command_line_is_one_line(capsys):
    from reference.cli import main

    assert main(["train", "--task", "examples.reverse_task:Nope", "--steps", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: task: task 'examples.reverse_task:Nope': module 'examples.reverse_task' has no class 'Nope'"
    ]
    assert main(["train", "--config", "examples/reverse-task.yaml", "--set", "task.options.digits=9"]) == 2
    assert capsys.readouterr().err.strip() == "error: task: digits must be an integer in [2, 8], got 9"


def test_the_custom_task_config_plans(capsys):
    from reference.cli import main
    from reference.control.config import load_train_config

    cfg = load_train_config("examples/reverse-task.yaml")
    assert (cfg.task.name, cfg.task.options, cfg.policy.num_steps) == (REVERSE, {"digits": 3}, 300)
    assert main(["train", "--config", "examples/reverse-task.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"task {REVERSE}, policy tag" in out and "up to 3 tokens generated" in out


def test_grpo_steps_on_the_custom_task_through_the_trainer():
    """The trainer's own loop on the task, in this process (no Ray, no engines): sampled, graded, two steps."""
    from reference.trainer.probe import run_probe
    from reference.trainer.recipe import MathRecipe

    tiny = MathRecipe(task=REVERSE, hidden_size=32, num_layers=1, head_dim=16, intermediate_size=64,
                      prompts_per_step=4, group_size=4)  # fmt: skip
    lines: list[str] = []
    result = run_probe(tiny, seed=0, max_steps=2, eval_every_steps=100, log=lines.append)
    assert result.steps == 2 and 0 <= result.train_reward <= 1 and 0 <= result.held_out_reward <= 1
    assert lines[0].startswith("seed 0: random-policy reward") and lines[-1].startswith("step    2")


@pytest.mark.slow
def test_the_custom_task_trains_end_to_end_on_ray(tmp_path):
    """The README's command, at 2 small steps: Ray workers, engines and trainer shards import the task from the
    folder the run starts in (a held-out evaluation by a trainer shard each step proves a worker built it)."""
    out = tmp_path / "run"
    small = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_concurrency=32",
             "engine.max_batch=32", "run.eval_every_steps=1", "run.time_limit_s=300"]  # fmt: skip
    cmd = [sys.executable, "-m", "reference", "train", "--config", "examples/reverse-task.yaml", "--steps", "2",
           *(a for s in small for a in ("--set", s)), "--quiet", "--out", str(out)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the folder the run starts in finds it
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kinds = [(r["kind"], r.get("label")) for r in records]  # the middle evaluation by a trainer shard, in its worker
    assert kinds == [("held_out", "start"), ("step", None), ("held_out", None), ("step", None), ("held_out", "end")]
    assert all(0 <= r["reward_mean"] <= 1 for r in records)
