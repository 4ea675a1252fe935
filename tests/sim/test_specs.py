"""Tests for core.specs as the simulator uses them: shipped specs against their published config.json,
Hugging Face config.json and device YAML files as `model` / `cluster.device`, mixture-of-experts in
the cost model, and one clear error naming the key for each kind of bad input."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
import yaml

from core import specs
from core.errors import UserError
from core.metrics import summarize
from sim.cli import main
from sim.config import load_config
from sim.cost import GB, TFLOP, CostModel, expected_experts
from sim.runner import simulate

# Published config.json files (Hugging Face model repositories), key for key as released; keys the
# simulator does not read are kept to show that they are ignored.
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN25_7B = {  # Qwen/Qwen2.5-7B-Instruct: no head_dim (hidden / heads), biased q/k/v by model_type
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}
LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B-Instruct
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.3",
    "use_cache": True,
    "vocab_size": 128256,
}
H800_FILE = {  # the shipped h800 entry, as a user's device file
    "description": "NVIDIA H800 SXM5 80GB",
    "peak_tflops": 989.0,
    "hbm_gb": 80.0,
    "hbm_bandwidth_gb_s": 3350.0,
    "nvlink_gb_s": 160.0,
    "network_gb_s": 48.0,
    "pcie_gb_s": 64.0,
    "gpus_per_node": 8,
}
SMALL = ["num_steps=2", "cluster.num_gpus=32", "workload.prompts_per_step=16", "rollout.tensor_parallel=2"]


def write_json(tmp_path, data, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def write_yaml(tmp_path, data, name: str = "mygpu.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def cost_model(*overrides: str) -> CostModel:
    cfg = load_config(overrides=["cluster.num_gpus=8", *overrides])
    return CostModel(cfg, specs.model(cfg.model), specs.device(cfg.cluster.device))


def cli_error(capsys, tmp_path, monkeypatch, *overrides: str) -> str:
    """Run the CLI with these overrides, expect one `error:` line and exit status 2; return the line."""
    monkeypatch.chdir(tmp_path)
    argv = [a for o in overrides for a in ("--set", o)]
    assert main([*argv, "--quiet", "--no-picture", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ")
    return err[0]


# ---- shipped specs ----

# Parameter counts of transformers' own model classes for these configs (instantiated on the meta
# device: sum of numel over parameters), so the formulas in ModelSpec are checked to the parameter.
EXACT_PARAMS = {
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "qwen3-30b-a3b": 30_532_122_624,
    "llama-3.1-8b": 8_030_261_248,
}


@pytest.mark.parametrize(("name", "count"), EXACT_PARAMS.items())
def test_parameter_counts_equal_the_reference_implementation(name, count):
    assert specs.model(name).params == count


@pytest.mark.parametrize(
    ("name", "billions"),
    [  # the model cards' "Number of Parameters"
        ("qwen2.5-1.5b", 1.54),
        ("qwen2.5-3b", 3.09),
        ("qwen2.5-14b", 14.7),
        ("qwen2.5-72b", 72.7),
        ("qwen3-235b-a22b", 235.0),
        ("llama-3.1-70b", 70.6),
        ("llama-3.3-70b", 70.6),
        ("llama-3.1-405b", 405.0),
    ],
)
def test_parameter_counts_match_the_model_cards(name, billions):
    assert specs.model(name).params / 1e9 == pytest.approx(billions, rel=0.005)


@pytest.mark.parametrize(("name", "active_billions"), [("qwen3-30b-a3b", 3.3), ("qwen3-235b-a22b", 22.0)])
def test_moe_active_parameters_match_the_model_cards(name, active_billions):
    """The cards' activated parameters include the input embedding, which matmul_params leaves out."""
    m = specs.model(name)
    assert (m.matmul_params + m.vocab * m.hidden) / 1e9 == pytest.approx(active_billions, rel=0.03)
    assert m.matmul_params < m.params / 9  # FLOPs from about a tenth of the weights


def test_every_shipped_device_and_model_loads():
    assert set(specs.devices()) == {"h800", "h100", "h200", "b200", "h20", "a100", "l40s"}
    assert {"qwen3-32b", "qwen3-30b-a3b", "qwen3-235b-a22b", "qwen2.5-72b", "llama-3.1-405b"} <= set(specs.models())
    assert specs.device("H200").hbm_gb == 141.0  # names are case-blind


# ---- config.json and device files ----


@pytest.mark.parametrize(
    ("shipped", "config"),
    [
        ("qwen3-8b", QWEN3_8B),
        ("qwen3-30b-a3b", QWEN3_30B_A3B),
        ("qwen2.5-7b", QWEN25_7B),
        ("llama-3.1-8b", LLAMA_31_8B),
    ],
)
def test_a_config_json_gives_the_shipped_spec(tmp_path, shipped, config):
    path = write_json(tmp_path, config)
    loaded = specs.model(path)
    assert loaded == specs.model(shipped)
    assert loaded.name == path
    assert specs.model(str(tmp_path)) == loaded  # the model's folder works too


def test_which_layers_are_moe_follows_the_config(tmp_path):
    sparse = {**QWEN3_30B_A3B, "decoder_sparse_step": 2, "mlp_only_layers": [1, 3]}  # MoE: 1, 3, 5, ... but not 1, 3
    m = specs.model(write_json(tmp_path, sparse))
    assert m.moe_layers == 22
    assert m.dense_layers == 26
    assert m.layer_params == m.moe_layer_params > m.dense_layer_params
    mixtral_like = {**LLAMA_31_8B, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    m = specs.model(write_json(tmp_path, mixtral_like, "mixtral.json"))
    assert (m.experts, m.experts_per_token, m.expert_intermediate, m.moe_layers) == (8, 2, 14336, 32)


def test_a_device_file_loads_and_runs_like_the_shipped_device(tmp_path):
    """The same model and device given as files: the same simulated run, interval for interval."""
    model_path, device_path = write_json(tmp_path, QWEN3_8B), write_yaml(tmp_path, H800_FILE)
    assert specs.device(device_path) == replace(specs.device("h800"), name="mygpu")
    by_name = load_config(overrides=[*SMALL, "model=qwen3-8b", "cluster.device=h800"])
    by_file = load_config(overrides=[*SMALL, f"model={model_path}", f"cluster.device={device_path}"])
    a, b = simulate(by_name, "tag"), simulate(by_file, "tag")
    assert a.intervals == b.intervals
    assert {k: v for k, v in summarize(a).items() if k != "policy"} == {
        k: v for k, v in summarize(b).items() if k != "policy"
    }


# ---- mixture-of-experts in the cost model ----


def test_expected_experts_against_a_simulated_router():
    """E(1 - (1 - k/E)^b) against uniform routing drawn at random (seeded)."""
    rng = random.Random(0)
    for experts, k, tokens in ((16, 2, 1), (16, 2, 5), (128, 8, 4), (8, 2, 30)):
        trials = 4000
        mean = sum(len({e for _ in range(tokens) for e in rng.sample(range(experts), k)}) for _ in range(trials))
        assert mean / trials == pytest.approx(expected_experts(experts, k, tokens), rel=0.03)


def test_moe_decode_reads_the_active_experts_at_batch_one_and_nearly_all_at_a_large_batch():
    cm = cost_model("model=qwen3-30b-a3b", "rollout.tensor_parallel=1")
    m = cm.model
    all_experts = m.moe_layers * m.experts * m.routed_expert_bytes
    dense_part = m.weight_bytes - all_experts
    one = cm.weight_bytes_read(1)
    assert one == pytest.approx(dense_part + m.moe_layers * m.experts_per_token * m.routed_expert_bytes, rel=1e-12)
    assert one < 0.15 * m.weight_bytes  # about the active weights: 3.9 of 61 GB
    assert cm.weight_bytes_read(256) == pytest.approx(m.weight_bytes, rel=1e-6)  # 128 x (1 - (15/16)^256)
    reads = [cm.weight_bytes_read(b) for b in (1, 2, 4, 16, 64, 256)]
    assert reads == sorted(reads)
    # a decode step is memory-bound at batch 1: its time is the bytes read, not all the weights
    c, hbm = cm.cfg.costs, cm.device.hbm_bandwidth_gb_s * GB * cm.cfg.costs.hbm_efficiency
    assert cm.decode_step_s(1, 0) == pytest.approx(one / hbm + c.decode_step_overhead_s, rel=1e-12)


def test_moe_decode_computes_with_the_active_parameters():
    cm = cost_model("model=qwen3-30b-a3b", "rollout.tensor_parallel=1")
    m, c = cm.model, cm.cfg.costs
    flops_per_s = cm.device.peak_tflops * TFLOP * c.decode_mfu
    lines = cm.decode_lines(64, 0)
    assert lines.p2 == pytest.approx(2 * m.matmul_params * 64 / flops_per_s, rel=1e-12)
    unused = m.moe_layers * (m.experts - m.experts_per_token) * m.expert_params
    assert m.matmul_params == m.params - unused - m.vocab * m.hidden - m.hidden  # less input embedding, final norm
    prefill_flops = 2 * m.matmul_params * 10_000 / (cm.device.peak_tflops * TFLOP * c.prefill_mfu)
    assert cm.prefill_s(10_000, 0) == pytest.approx(prefill_flops, rel=1e-12)  # compute-bound


def test_moe_decode_closed_form_equals_the_naive_sum():
    cm = cost_model("model=qwen3-30b-a3b", "rollout.tensor_parallel=2")
    for batch, sum_ctx, steps in ((1, 0, 50), (3, 3000, 400), (40, 40 * 2000, 900), (256, 256 * 500, 300)):
        naive = sum(cm.decode_step_s(batch, sum_ctx + batch * j) for j in range(steps))
        assert cm.decode_run_s(batch, sum_ctx, steps) == pytest.approx(naive, rel=1e-9)


def test_moe_memory_and_weight_sync_count_every_expert():
    cm = cost_model("model=qwen3-30b-a3b", "rollout.tensor_parallel=2")
    m, d, c = cm.model, cm.device, cm.cfg.costs
    assert m.weight_bytes == 2 * m.params
    assert cm.sync_s(True, 1) == pytest.approx(m.weight_bytes / 2 / (d.nvlink_gb_s * GB * c.nvlink_efficiency) + 1.0)
    per_gpu = d.hbm_gb * GB * cm.cfg.rollout.gpu_memory_utilization - cm.cfg.rollout.workspace_gb * GB
    assert cm.kv_capacity_tokens() == int((per_gpu - m.weight_bytes / 2) * 2 // m.kv_bytes_per_token)


def test_dense_models_read_every_weight_at_any_batch():
    cm = cost_model("model=qwen3-8b")
    assert {cm.weight_bytes_read(b) for b in (1, 7, 256)} == {cm.model.weight_bytes}


# ---- bad input: one line naming the key ----


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", r"model: model config '.*config.json' is not valid JSON: "),
        ([1, 2], r"must hold a JSON object, got list"),
        ({k: v for k, v in QWEN3_8B.items() if k != "hidden_size"}, r"lacks the key 'hidden_size'"),
        ({**QWEN3_8B, "hidden_size": "4096"}, r"key 'hidden_size' must be an integer, got '4096'"),
        ({**QWEN3_8B, "num_hidden_layers": 0}, r"key 'num_hidden_layers' must be >= 1, got 0"),
        ({**QWEN3_8B, "tie_word_embeddings": "false"}, r"key 'tie_word_embeddings' must be true or false"),
        ({**QWEN3_30B_A3B, "num_experts_per_tok": 200}, r"key 'num_experts_per_tok' \(200\) exceeds num_experts"),
        ({**QWEN3_30B_A3B, "mlp_only_layers": "all"}, r"key 'mlp_only_layers' must be a list of integers"),
        (
            {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts_per_tok"},
            r"lacks the key 'num_experts_per_tok'",
        ),
        ({**QWEN3_8B, "kv_lora_rank": 512}, r"key 'kv_lora_rank' \(multi-head latent attention\) is not modelled"),
        ({**QWEN3_8B, "layer_types": ["sliding_attention"]}, r"key 'layer_types' has \['sliding_attention'\]"),
    ],
)
def test_a_bad_config_json_is_one_error_naming_the_key(capsys, tmp_path, monkeypatch, config, message):
    path = write_json(tmp_path, config)
    line = cli_error(capsys, tmp_path, monkeypatch, f"model={path}")
    assert line.startswith("error: model: model config ")
    assert pytest.raises(UserError, specs.model, path).match(message.removeprefix("model: "))


def test_an_unknown_model_path_names_the_key(capsys, tmp_path, monkeypatch):
    line = cli_error(capsys, tmp_path, monkeypatch, "model=no/such/config.json")
    expected = "model: model config 'no/such/config.json' does not exist; give a shipped model name or a Hugging Face"
    assert line == f"error: {expected} config.json"


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ({k: v for k, v in H800_FILE.items() if k != "hbm_gb"}, "device file '{path}' lacks 'hbm_gb'"),
        ({**H800_FILE, "hbm_gb": "80GB"}, "device file '{path}': 'hbm_gb' must be a number, got '80GB'"),
        ({**H800_FILE, "gpus_per_node": 8.5}, "device file '{path}': 'gpus_per_node' must be an integer, got 8.5"),
        ({**H800_FILE, "hbm_gbs": 80}, "device file '{path}': unknown key 'hbm_gbs'; valid keys: name, description,"),
        ({**H800_FILE, "hbm_gb": 0}, "device 'mygpu': hbm_gb must be > 0, got 0.0"),
        ("peak_tflops: [", "device file '{path}' is not valid YAML"),
        ([1, 2], "device file '{path}' must be a mapping of keys to values"),
    ],
)
def test_a_bad_device_file_is_one_error_naming_the_key(capsys, tmp_path, monkeypatch, device, message):
    path = write_yaml(tmp_path, device)
    line = cli_error(capsys, tmp_path, monkeypatch, f"cluster.device={path}")
    assert line.startswith("error: cluster.device: " + message.format(path=path))


def test_a_missing_device_file_names_the_key(capsys, tmp_path, monkeypatch):
    line = cli_error(capsys, tmp_path, monkeypatch, "cluster.device=gpus/mine.yaml")
    assert line.startswith("error: cluster.device: device file 'gpus/mine.yaml' does not exist")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (  # all 128 experts of 94 layers: 470 GB of weights
            ["model=qwen3-235b-a22b", "rollout.tensor_parallel=4"],
            [
                "qwen3-235b-a22b does not fit for inference: 117.5 GB of weights (all 128 experts a layer) per GPU",
                "raise rollout.tensor_parallel",
            ],
        ),
        (
            ["model=llama-3.1-70b", "cluster.device=l40s", "rollout.tensor_parallel=2"],
            ["llama-3.1-70b does not fit for inference", "on one l40s", "raise rollout.tensor_parallel"],
        ),
        (
            [  # 61.1 GB of weights leave 0.5 GB of the 61.6 GB usable
                "model=qwen3-30b-a3b",
                "rollout.tensor_parallel=1",
                "cluster.device=h200",
                "rollout.gpu_memory_utilization=0.465",
            ],
            ["KV cache of one engine holds", "short by", "raise rollout.tensor_parallel"],
        ),
    ],
)
def test_a_layout_that_does_not_fit_names_the_constraint(capsys, tmp_path, monkeypatch, overrides, expected):
    line = cli_error(capsys, tmp_path, monkeypatch, *overrides)
    for part in expected:
        assert part in line


def test_a_folder_or_binary_file_as_a_device_is_one_error(capsys, tmp_path, monkeypatch):
    (tmp_path / "gpus").mkdir()
    line = cli_error(capsys, tmp_path, monkeypatch, f"cluster.device={tmp_path / 'gpus'}")
    assert line.startswith(f"error: cluster.device: device file '{tmp_path / 'gpus'}' is a folder")
    binary = tmp_path / "mine.yaml"
    binary.write_bytes(b"\xd5\xff\x00peak")
    line = cli_error(capsys, tmp_path, monkeypatch, f"cluster.device={binary}")
    assert line.startswith(f"error: cluster.device: device file '{binary}' cannot be read: 'utf-8' codec")
