"""Tests for sim/calibration.py and `costs.profile`: a profile made by the roofline itself is fitted back
to its constants, what no point constrains is kept with its reason, a calibrated run differs from the
default, and a profile of another device, without the model or malformed is one line naming the key."""

from __future__ import annotations

import pytest
import yaml

from core import specs
from core.errors import UserError
from core.metrics import summarize
from sim import train_layout
from sim.calibration import measured_setup
from sim.cli import main
from sim.config import load_config
from sim.cost import CostModel
from sim.profile import (
    DecodePoint,
    DeviceInfo,
    LogprobPoint,
    ModelProfile,
    PrefillPoint,
    Profile,
    TrainPoint,
    profile_path,
    write_profile,
)
from sim.runner import simulate

TRUTH = {
    "hbm_efficiency": 0.62,
    "decode_mfu": 0.21,  # low enough for the largest batches to be compute-bound
    "decode_step_overhead_s": 0.0023,
    "decode_seq_overhead_s": 2e-5,  # the host's work per sequence of a step
    "prefill_mfu": 0.47,
    "prefill_overhead_s": 0.004,  # an engine's fixed cost of a step that prefills
    "train_mfu": 0.33,
    "logprob_mfu": 0.43,
}
MODEL, DEVICE = "qwen3-8b", "h800"


def roofline_profile(constants: dict, model: str = MODEL, device: str = DEVICE, copy_gb_s=None) -> Profile:
    """What the simulator's roofline predicts at `constants`, in the setup a profile is measured in (the
    device's copy bandwidth as measured where `copy_gb_s` is given)."""
    cfg = load_config(overrides=[f"model={model}", f"cluster.device={device}"])
    setup = measured_setup(cfg, **constants)
    m, d = specs.model(model), specs.device(device)
    cm = CostModel(setup, m, d)
    decode = tuple(DecodePoint(b, c, cm.decode_step_s(b, b * c)) for b in (1, 8, 64, 512) for c in (512, 4096))
    prefill = tuple(PrefillPoint(n, cm.prefill_s(n, n * n / 2) + cm.prefill_overhead_s) for n in (512, 2048, 8192))
    train = tuple(TrainPoint(n, n / train_layout.step(setup, m, d, [n], 1).total_s) for n in (512, 2048))
    peak = d.peak_tflops * 1e12 * setup.costs.logprob_mfu
    logprob = tuple(LogprobPoint(n, n * peak / train_layout.forward_flops(m, [n])) for n in (1024, 4096))
    info = DeviceInfo("roofline", "bfloat16", spec=device, copy_gb_s=copy_gb_s)
    return Profile(1, info, (ModelProfile(model, decode, prefill, train, logprob),))


def calibrated(path, *overrides: str) -> CostModel:
    cfg = load_config(overrides=[f"model={MODEL}", f"costs.profile={path}", *overrides])
    return CostModel(cfg, specs.model(cfg.model), specs.device(cfg.cluster.device))


@pytest.fixture
def truth_profile(tmp_path):
    return write_profile(roofline_profile(TRUTH), tmp_path / "truth.yaml")


def test_a_profile_made_by_the_roofline_is_fitted_back_to_its_constants(truth_profile):
    cal = calibrated(truth_profile).calibration
    assert set(cal.fitted) == set(TRUTH)
    assert cal.kept == {}
    for key, value in TRUTH.items():
        assert cal.constants[key] == pytest.approx(value, rel=1e-6), key
    assert max(cal.rms_error.values()) < 1e-6


def test_with_the_device_copy_measured_weights_stream_at_it_and_the_kv_cache_is_fitted(tmp_path):
    """A profile that measured the device's copy: the weights are read at that share of the datasheet
    (a dense model's weights and a step's fixed overhead cannot be told apart), the KV cache at its own
    fitted efficiency."""
    copy = 0.86 * specs.device(DEVICE).hbm_bandwidth_gb_s
    truth = {**TRUTH, "hbm_efficiency": 0.86, "kv_hbm_efficiency": 0.41}
    path = write_profile(roofline_profile(truth, copy_gb_s=copy), tmp_path / "copy.yaml")
    cal = calibrated(path).calibration
    assert set(cal.fitted) == set(truth) - {"hbm_efficiency"} and cal.kept == {}
    assert list(cal.measured) == ["hbm_efficiency"] and "copy" in cal.measured["hbm_efficiency"]
    for key, value in truth.items():
        assert cal.constants[key] == pytest.approx(value, rel=1e-6), key
    assert max(cal.rms_error.values()) < 1e-6
    assert cal.to_dict()["measured"]["hbm_efficiency"]["value"] == pytest.approx(0.86)


def test_the_kv_cache_read_at_its_own_efficiency_slows_decode_by_its_bytes():
    model, dev = specs.model(MODEL), specs.device(DEVICE)
    base = CostModel(load_config(overrides=[f"model={MODEL}"]), model, dev)
    slow = CostModel(load_config(overrides=[f"model={MODEL}", "costs.kv_hbm_efficiency=0.2"]), model, dev)
    weights, kv = base.decode_memory_s(8, 8 * 4096)
    weights_slow, kv_slow = slow.decode_memory_s(8, 8 * 4096)
    assert weights_slow == weights and kv_slow == pytest.approx(kv * base.cfg.costs.hbm_efficiency / 0.2)
    assert slow.decode_step_s(8, 8 * 4096) > base.decode_step_s(8, 8 * 4096)


def test_the_cost_model_runs_on_the_fitted_constants(truth_profile):
    cm = calibrated(truth_profile)
    for key, value in TRUTH.items():
        assert getattr(cm.cfg.costs, key) == pytest.approx(value, rel=1e-6), key
    default = CostModel(load_config(overrides=[f"model={MODEL}"]), specs.model(MODEL), specs.device(DEVICE))
    assert default.calibration is None
    assert cm.decode_step_s(64, 64 * 2048) != pytest.approx(default.decode_step_s(64, 64 * 2048), rel=0.01)
    assert cm.train_step_s([4096] * 64, 8) != pytest.approx(default.train_step_s([4096] * 64, 8), rel=0.01)


def test_provenance_names_fitted_and_kept_constants():
    record = calibrated("example-h800").calibration.to_dict()
    assert (record["profile"], record["device"], record["model"]) == ("example-h800", "h800", "qwen3-8b")
    assert set(record["fitted"]) == {"hbm_efficiency", "decode_step_overhead_s", "decode_seq_overhead_s", "prefill_mfu",
                                     "prefill_overhead_s", "train_mfu"}  # fmt: skip
    assert record["fitted"]["decode_seq_overhead_s"] == 0.0  # the example's points have no cost per sequence
    assert record["kept"]["decode_mfu"]["why"].startswith("every decode point is memory-bound")
    assert record["kept"]["decode_mfu"]["value"] == 0.45  # the config's, above the bound the points set
    assert record["points"] == {"decode": 11, "prefill": 3, "train": 2, "logprob": 0}
    assert record["kept"]["logprob_mfu"] == {"value": 0.5, "why": "no log-prob points"}
    assert record["measured"] == {}  # the example names no copy bandwidth


def test_a_calibrated_run_records_its_calibration_in_the_timeline():
    from sim.runner import simulate

    overrides = [f"model={MODEL}", "costs.profile=example-h800", "num_steps=1", "cluster.num_gpus=8",
                 "rollout.tensor_parallel=1", "workload.prompts_per_step=8"]  # fmt: skip
    timeline = simulate(load_config(overrides=overrides), "colocated")
    assert timeline.meta["calibration"] == calibrated("example-h800").calibration.to_dict()
    assert "calibration" not in simulate(load_config(overrides=overrides[:1] + overrides[2:]), "colocated").meta


def test_points_that_cannot_separate_bandwidth_from_overhead_fit_the_overhead_alone():
    """qwen3-32b on one GPU: every decode point reads about the same 65 GB of weights."""
    cal = calibrated("example-h800", "model=qwen3-32b").calibration
    assert cal.fitted == ("decode_step_overhead_s", "decode_seq_overhead_s", "prefill_mfu", "prefill_overhead_s")
    assert "do not pin the efficiencies down" in cal.kept["hbm_efficiency"]
    assert cal.constants["hbm_efficiency"] == 0.8  # the config's
    assert cal.kept["train_mfu"].startswith("no training points (train seq_len=512: out of memory")


def test_a_part_with_too_few_points_keeps_its_constants(tmp_path):
    profile = roofline_profile(TRUTH)
    entry = profile.models[0]
    thin = ModelProfile(MODEL, decode=entry.decode[:2], prefill=(), train=entry.train)
    cal = calibrated(write_profile(Profile(1, profile.device, (thin,)), tmp_path / "thin.yaml")).calibration
    assert cal.fitted == ("train_mfu",)
    assert "2 decode point(s)" in cal.kept["decode_mfu"]
    assert cal.kept["prefill_mfu"] == "no prefill points"


def test_a_calibrated_run_differs_from_the_default(small_config):
    default = summarize(simulate(small_config("num_steps=2"), "tag"))
    tuned = summarize(simulate(small_config("num_steps=2", "costs.profile=example-h800"), "tag"))
    assert tuned["token_throughput"] != pytest.approx(default["token_throughput"], rel=0.01)


def test_a_rollout_pool_of_another_device_keeps_the_config_constants():
    cfg = load_config(
        "sim/configs/hetero.yaml", ["model=qwen3-8b", "rollout.tensor_parallel=2", "costs.profile=example-h800"]
    )
    model = specs.model(cfg.model)
    assert CostModel(cfg, model, specs.device("h800")).calibration is not None
    assert CostModel(cfg, model, specs.device("h20")).calibration is None


def test_a_shipped_profile_is_found_by_name_and_a_file_by_path(truth_profile):
    assert profile_path("example-h800").name == "example-h800.yaml"
    assert profile_path(str(truth_profile)) == truth_profile


# ---- errors: one line, naming the key ----


def profile_error(*overrides: str) -> str:
    with pytest.raises(UserError) as info:
        load_config(overrides=list(overrides))
    return str(info.value)


def test_a_profile_of_another_device_is_refused():
    message = profile_error("model=qwen3-8b", "cluster.device=h100", "costs.profile=example-h800")
    assert message.startswith("costs.profile: profile 'example-h800' was measured on 'h800'")
    assert "not on cluster.device 'h100'" in message


def test_a_profile_without_a_device_spec_is_refused(tmp_path):
    profile = roofline_profile(TRUTH)
    cpu = Profile(1, DeviceInfo("x86_64", "float32"), profile.models)
    message = profile_error(f"model={MODEL}", f"costs.profile={write_profile(cpu, tmp_path / 'cpu.yaml')}")
    assert "was measured on 'x86_64' (device.spec: null)" in message


def test_a_profile_without_the_model_lists_what_it_has():
    message = profile_error("model=qwen3-4b", "costs.profile=example-h800")
    assert message == (
        "costs.profile: profile 'example-h800' has no measurements of model 'qwen3-4b'; it has qwen3-8b, qwen3-32b"
    )


def test_a_malformed_profile_names_the_key(truth_profile):
    data = yaml.safe_load(truth_profile.read_text())
    data["models"][0]["decode"][1]["step_s"] = -1
    truth_profile.write_text(yaml.safe_dump(data))
    message = profile_error(f"model={MODEL}", f"costs.profile={truth_profile}")
    assert message.startswith(f"costs.profile: profile {str(truth_profile)!r}: models[0].decode[1].step_s must be")


def test_a_missing_profile_lists_the_shipped_ones():
    message = profile_error("costs.profile=nowhere")
    shipped = "example-h800, h200-torch"
    assert message == f"costs.profile: profile 'nowhere' is neither a shipped profile ({shipped}) nor a file"


def test_the_cli_prints_one_line_without_a_traceback(capsys, tmp_path):
    rc = main(["--set", "costs.profile=example-h800", "--set", "cluster.device=a100", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1
    assert err.startswith("error: costs.profile: profile 'example-h800' was measured on 'h800'")


@pytest.mark.parametrize("allocation", ["paged", "reserve"])
def test_an_engine_charges_the_fixed_cost_of_each_prefill(allocation):
    """One request on one engine, prefilled once: the run is one prefill_overhead_s longer, and nothing else
    changes."""
    base = ["model=qwen3-0.6b", "cluster.num_gpus=1", "rollout.tensor_parallel=1", "num_steps=1",
            "workload.prompts_per_step=1", "workload.group_size=1", "workload.prompt_tokens.sigma=0",
            "workload.response_tokens.sigma=0", f"rollout.kv_allocation={allocation}"]  # fmt: skip
    plain = summarize(simulate(load_config(overrides=base), "colocated"))
    charged = summarize(simulate(load_config(overrides=[*base, "costs.prefill_overhead_s=0.25"]), "colocated"))
    assert charged["wall_s"] - plain["wall_s"] == pytest.approx(0.25, rel=1e-9)
    assert charged["counters"] == plain["counters"]


def test_a_decode_step_pays_the_host_cost_of_each_sequence():
    base = [f"model={MODEL}"]
    plain = CostModel(load_config(overrides=base), specs.model(MODEL), specs.device(DEVICE))
    charged = CostModel(load_config(overrides=[*base, "costs.decode_seq_overhead_s=1e-4"]), specs.model(MODEL),
                        specs.device(DEVICE))  # fmt: skip
    for batch in (1, 32, 256):
        extra = charged.decode_run_s(batch, batch * 1000, 10) - plain.decode_run_s(batch, batch * 1000, 10)
        assert extra == pytest.approx(10 * batch * 1e-4, rel=1e-9)
        assert charged.decode_lines(batch, batch * 1000).overhead - plain.decode_lines(batch, 1000).overhead == (
            pytest.approx(batch * 1e-4, rel=1e-9)
        )


def test_the_shipped_h200_profile_sets_what_the_default_config_cites():
    """sim/configs/profiles/h200-torch.yaml (one H200, plain torch) is where the default config's prefill_mfu,
    logprob_mfu and hbm_efficiency comments come from: its fits stay in those ranges."""
    for model, prefill in (("qwen3-14b", 0.55), ("qwen3-32b", 0.55), ("qwen3-8b", 0.61)):
        cfg = load_config(overrides=[f"model={model}", "cluster.device=h200", "costs.profile=h200-torch"])
        cal = CostModel(cfg, specs.model(model), specs.device("h200")).calibration
        assert cal.constants["prefill_mfu"] == pytest.approx(prefill, abs=0.01), model
        assert (
            cal.constants["hbm_efficiency"] == pytest.approx(0.86, abs=0.01)
            and "copy" in cal.measured["hbm_efficiency"]
        )
        assert 0.40 <= cal.constants["logprob_mfu"] <= 0.5, model
        assert "kv_hbm_efficiency" in cal.kept  # plain torch's attention does not pin it down
    assert "train_mfu" in cal.fitted or "no training points" in cal.kept["train_mfu"]
