"""`python -m reference train --dry-run`: the plan of a run, from its config alone, in this process.

Nothing is started: no Ray, engine, trainer, vLLM or Docker (a SWE task is never constructed). Memory
figures are checked against the arithmetic written out here, from Qwen3-32B's published config.json.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from core.errors import UserError
from reference.cli import main
from reference.control.config import load_train_config
from reference.control.plan import plan

GPU_CONFIG = Path(__file__).resolve().parents[3] / "reference" / "configs" / "swe-gpu.yaml"
QWEN3_32B = {  # Qwen/Qwen3-32B config.json, the keys core/specs/hf_config.py reads
    "model_type": "qwen3", "num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600, "vocab_size": 151936,
    "max_position_embeddings": 40960, "tie_word_embeddings": False,
}  # fmt: skip
PARAMS_32B = 32_762_123_264  # counted from the shape (tests/core/test_specs.py holds it to the model card)


@pytest.fixture
def qwen3_32b(tmp_path) -> str:
    """A checkpoint folder holding only Qwen3-32B's config.json: all a dry run reads."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_32B))
    return str(tmp_path)


def _number(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found, (pattern, text)
    return float(found.group(1).replace(",", ""))


def test_the_default_cpu_config_plans_and_fits(capsys):
    assert main(["train", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "nothing was started" in out
    assert re.search(r"R00 +rollout +rollout +1", out)
    assert re.search(r"T00 +rollout, train +rollout +1", out)
    assert "engines: 2, backend builtin, tensor parallel 1, max batch 128" in out
    assert out.rstrip().endswith("fits: yes")


def test_colocated_lays_out_two_train_capable_resources():
    text = plan(load_train_config(None, ["policy.name=colocated"]))
    assert len(re.findall(r"rollout, train", text)) == 2


def test_the_gpu_recipe_plans_engines_sandboxes_and_memory(capsys, qwen3_32b):
    assert main(["train", "--config", str(GPU_CONFIG), "--model", qwen3_32b, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "16 x 4 GPUs (h800: 80 GB) = 64 GPUs" in out
    assert "engines: 16, backend vllm, tensor parallel 4, max batch 64, context 32768 tokens" in out
    assert "256 episodes (task.options.concurrency 256), 256 sandboxes" in out
    assert "16 engines serve at the start: up to 16 sequences each" in out
    assert _number(r"rollout-only resource: weights ([\d.]+) GB", out) == round(2 * PARAMS_32B / 4 / 1e9, 1)
    kv_per_token = 2 * 64 * 8 * 128 * 2  # K and V, layers, KV heads, head_dim, bf16
    free = (80 * 0.85 - 4.0) * 1e9 - 2 * PARAMS_32B / 4  # vLLM's share less the workspace and weights, a GPU
    assert _number(r"KV cache ([\d,]+) tokens", out) == int(free * 4 // kv_per_token)
    state = 16 * PARAMS_32B / 32 / 1e9  # fp32 weights, gradients, two AdamW moments over 32 GPUs
    assert _number(r"state ([\d.]+) GB", out) == round(state, 1)
    assert "(32768 tokens, bf16, recomputed a layer at a time)" in out  # the recipe's trainer_parallel
    assert "fits: no: training needs" not in out
    assert "fits: no: the workers do not place GPUs yet" in out


def test_without_fsdp_the_plan_counts_whole_replicas_and_names_the_settings(qwen3_32b):
    overrides = [f"model.dir={qwen3_32b}", "trainer_parallel={fsdp: false, param_dtype: float32, "
                 "activation_checkpointing: false}"]  # fmt: skip
    text = plan(load_train_config(GPU_CONFIG, overrides))
    assert _number(r"state ([\d.]+) GB", text) == round(16 * PARAMS_32B / 1e9, 1)  # not divided by 32 GPUs
    assert "a whole replica: trainer_parallel.fsdp is off" in text
    assert "data parallel (whole replicas) over 32 GPUs" in text
    assert ("fits: no: training needs" in text and "set trainer_parallel.activation_checkpointing=true and "
            "trainer_parallel.param_dtype=bfloat16 (with fsdp), or lower the task's context" in text)  # fmt: skip


def test_an_engine_whose_kv_cache_holds_no_request_is_named(qwen3_32b):
    overrides = [f"model.dir={qwen3_32b}", "resources.gpus_per_resource=1"]
    text = plan(load_train_config(GPU_CONFIG, overrides))
    assert "fits: no: an engine's KV cache holds 0 tokens, less than one request of 32768" in text


def test_the_swe_task_is_read_from_its_config_never_built(monkeypatch, qwen3_32b):
    from swebench_env.training import SweTask

    def refuse(*args, **kwargs):
        raise AssertionError("the dry run constructed the SWE task")

    monkeypatch.setattr(SweTask, "__init__", refuse)
    cfg = load_train_config(GPU_CONFIG, [f"model.dir={qwen3_32b}", "task.options.concurrency=8"])
    assert "32 groups of 8 (rollout.max_concurrency 256) -> 8 episodes" in plan(cfg)
    with pytest.raises(UserError, match="task: got an unexpected keyword argument 'turns'"):
        plan(load_train_config(GPU_CONFIG, [f"model.dir={qwen3_32b}", "task.options.turns=3"]))


@pytest.mark.parametrize("task", ["math", "throughput"])
def test_a_single_turn_context_follows_the_runtime_rule(task):
    from reference.control.layout import task_context
    from reference.control.plan import task_plan
    from reference.tasks import make_task

    cfg = load_train_config(None, [f"task.name={task}"])
    assert task_plan(cfg).context_tokens == task_context(make_task(task))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["resources.gpus_per_resource=-1"], "resources.gpus_per_resource must be >= 0"),
        (["resources.gpus_per_resource=4"], "needs resources.gpu"),
        (["resources.gpus_per_resource=3", "resources.gpu=h800"], "must divide the 8 GPUs of a h800 node"),
        (["resources.gpus_per_resource=4", "resources.gpu=z9000"], "resources.gpu: unknown device 'z9000'"),
    ],
)
def test_bad_gpu_settings_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        load_train_config(None, overrides)


def test_a_token_budget_sizes_the_micro_batch_and_is_named_when_it_does_not_fit(qwen3_32b):
    text = plan(load_train_config(GPU_CONFIG, [f"model.dir={qwen3_32b}", "trainer.micro_batch_tokens=65536"]))
    assert "micro-batches of up to 65536 padded tokens (trainer.micro_batch_tokens)" in text
    assert "(65536 tokens, bf16, recomputed a layer at a time)" in text
    assert "lower trainer.micro_batch_tokens (to 32768: one sequence at a time)" in text
    small = plan(load_train_config(GPU_CONFIG, [f"model.dir={qwen3_32b}", "trainer.micro_batch_tokens=1024"]))
    assert "(32768 tokens, bf16" in small  # a sequence longer than the budget is a micro-batch of its own
