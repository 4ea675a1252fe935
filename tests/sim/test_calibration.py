"""Tests for sim/calibration.py and `costs.profile`: a profile made by the roofline itself is fitted back
to its constants, what no point constrains is kept with its reason, a calibrated run differs from the
default, and a profile of another device, without the model or malformed is one line naming the key."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from core import specs
from core.errors import UserError
from core.metrics import summarize
from sim import calibration, train_layout
from sim.calibration import calibrated_cost_model, measured_setup
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
    read_profile,
    write_profile,
)
from sim.runner import simulate

TRUTH = {  # one device's constants: every term the fit knows, each with a visible share of some points
    "hbm_efficiency": 0.62,
    "decode_mfu": 0.21,  # low enough for the largest batches to be compute-bound
    "decode_layer_overhead_s": 6e-5,  # a step's small kernels, per layer
    "decode_seq_layer_overhead_s": 4e-7,  # per layer and sequence
    "decode_ctx_latency_s": 1.2e-8,  # attention's walk over one sequence's cache, per layer and context token
    "prefill_mfu": 0.47,
    "prefill_attention_mfu": 0.25,
    "prefill_layer_host_s": 4e-4,  # eager launches: bind the small model's short prefills
    "train_mfu": 0.33,
    "train_layer_host_s": 3e-3,
    "train_attention_mfu": 0.15,  # long sequences: attention's share grows with the length
    "logprob_mfu": 0.43,
    "logprob_attention_mfu": 0.2,
    "logprob_layer_host_s": 6e-4,
}
MODELS = ("qwen3-0.6b", "qwen3-8b", "qwen3-32b")  # layers 28, 36, 64: per-layer and per-step costs differ
MODEL, DEVICE = "qwen3-8b", "h800"
REPLACED = {"decode_step_overhead_s", "decode_seq_overhead_s", "prefill_overhead_s"}  # by the per-layer terms


def roofline_profile(constants: dict, models=MODELS, device: str = DEVICE, copy_gb_s=None) -> Profile:
    """What the simulator's cost model predicts at `constants` for each model, in the setup a profile is
    measured in (the device's copy bandwidth as measured where `copy_gb_s` is given)."""
    entries = []
    for model in models:
        cfg = load_config(overrides=[f"model={model}", f"cluster.device={device}"])
        setup = measured_setup(cfg, **dict.fromkeys(REPLACED, 0.0), **constants)  # the per-step costs: 0 unless given
        m, d = specs.model(model), specs.device(device)
        cm = CostModel(setup, m, d)
        c = setup.costs
        decode = tuple(DecodePoint(b, n, cm.decode_step_s(b, b * n)) for b in (1, 8, 64, 512) for n in (512, 4096))
        prefill = tuple(PrefillPoint(n, cm.prefill_s(n, n * n / 2) + cm.prefill_overhead_s) for n in (256, 2048, 8192))
        train = tuple(TrainPoint(n, n / train_layout.step(setup, m, d, [n], 1).total_s) for n in (256, 1024, 4096))
        logprob = tuple(
            LogprobPoint(n, n / train_layout.forward_s(m, d, n, c.logprob_mfu, c.logprob_attention_mfu,
                                                       c.logprob_layer_host_s))
            for n in (256, 2048, 8192)
        )  # fmt: skip
        entries.append(ModelProfile(model, decode, prefill, train, logprob))
    info = DeviceInfo("roofline", "bfloat16", spec=device, copy_gb_s=copy_gb_s)
    return Profile(1, info, tuple(entries))


def calibrated(path, *overrides: str) -> tuple[CostModel, calibration.Calibration | None]:
    """The cost model a run with costs.profile=`path` prices its work with, and the calibration it runs on."""
    cfg = load_config(overrides=[f"model={MODEL}", f"costs.profile={path}", *overrides])
    return calibrated_cost_model(cfg, specs.model(cfg.model), specs.device(cfg.cluster.device))


@pytest.fixture(scope="module")
def truth_profile(tmp_path_factory):
    return write_profile(roofline_profile(TRUTH), tmp_path_factory.mktemp("truth") / "truth.yaml")


def test_a_profile_made_by_the_roofline_is_fitted_back_to_its_constants(truth_profile):
    """Every term, each known to the fit, recovered from three models' points at once: one set of constants
    for the device."""
    _, cal = calibrated(truth_profile)
    assert set(cal.fitted) == set(TRUTH)
    assert set(cal.kept) == REPLACED and all(cal.constants[k] == 0.0 for k in REPLACED)
    for key, value in TRUTH.items():
        assert cal.constants[key] == pytest.approx(value, rel=1e-4), key
    assert cal.models == MODELS
    for model in MODELS:
        assert max(cal.rms_error_by_model[model].values()) < 1e-5, model
    assert cal.rms_error == cal.rms_error_by_model[MODEL]


@pytest.mark.parametrize("term", ["decode_ctx_latency_s", "decode_seq_layer_overhead_s", "prefill_layer_host_s",
                                  "prefill_attention_mfu", "logprob_attention_mfu", "train_layer_host_s"])  # fmt: skip
def test_each_new_term_explains_a_share_of_its_parts_points(term):
    """With one term wrong (0 seconds, or an efficiency of 0.9), the cost model misses the truth's points of its
    part by more than 1% (the fit above: 0.001%): each term is seen in the points it is fitted to."""
    wrong = {**TRUTH, term: 0.0 if term.endswith("_s") else 0.9}
    parts = {"decode": calibration.DECODE, "prefill": calibration.PREFILL, "train": calibration.TRAIN,
             "logprob": calibration.LOGPROB}  # fmt: skip
    part = next(name for name, keys in parts.items() if term in keys)
    entry = roofline_profile(TRUTH, models=(MODEL,)).models[0]
    cfg = measured_setup(load_config(overrides=[f"model={MODEL}", f"cluster.device={DEVICE}"]), **wrong)
    cm = CostModel(cfg, specs.model(MODEL), specs.device(DEVICE))
    assert calibration._errors(cm, cfg, entry)[part] > 0.01


def test_with_the_device_copy_measured_weights_stream_at_it_and_the_kv_cache_is_fitted(tmp_path):
    """A profile that measured the device's copy: the weights are read at that share of the datasheet
    (a dense model's weights and a step's fixed overhead cannot be told apart), the KV cache at its own
    fitted efficiency."""
    copy = 0.86 * specs.device(DEVICE).hbm_bandwidth_gb_s
    truth = {**TRUTH, "hbm_efficiency": 0.86, "kv_hbm_efficiency": 0.41}
    path = write_profile(roofline_profile(truth, copy_gb_s=copy), tmp_path / "copy.yaml")
    _, cal = calibrated(path)
    assert set(cal.fitted) == set(truth) - {"hbm_efficiency"} and set(cal.kept) == REPLACED
    assert list(cal.measured) == ["hbm_efficiency"] and "copy" in cal.measured["hbm_efficiency"]
    for key, value in truth.items():
        assert cal.constants[key] == pytest.approx(value, rel=1e-4), key
    assert max(cal.rms_error.values()) < 1e-5
    assert cal.to_dict()["measured"]["hbm_efficiency"]["value"] == pytest.approx(0.86)


def test_a_model_the_profile_did_not_measure_runs_on_the_devices_constants(truth_profile):
    _, cal = calibrated(truth_profile, "model=qwen3-14b")
    assert cal.model is None and cal.rms_error == {} and cal.points == dict.fromkeys(cal.points, 0)
    assert cal.constants == calibrated(truth_profile)[1].constants
    assert cal.to_dict()["fitted_to"] == list(MODELS)


def test_the_kv_cache_read_at_its_own_efficiency_slows_decode_by_its_bytes():
    model, dev = specs.model(MODEL), specs.device(DEVICE)
    base = CostModel(load_config(overrides=[f"model={MODEL}"]), model, dev)
    slow = CostModel(load_config(overrides=[f"model={MODEL}", "costs.kv_hbm_efficiency=0.2"]), model, dev)
    assert slow.decode_weights_s(8) == base.decode_weights_s(8)
    kv, kv_slow = base.terms.decode.kv_s_per_token, slow.terms.decode.kv_s_per_token
    assert kv_slow == pytest.approx(kv * base.cfg.costs.hbm_efficiency / 0.2)
    assert slow.decode_step_s(8, 8 * 4096) > base.decode_step_s(8, 8 * 4096)


def test_the_cost_model_runs_on_the_fitted_constants(truth_profile):
    cm, _ = calibrated(truth_profile)
    for key, value in TRUTH.items():
        assert getattr(cm.cfg.costs, key) == pytest.approx(value, rel=1e-6), key
    default = CostModel(load_config(overrides=[f"model={MODEL}"]), specs.model(MODEL), specs.device(DEVICE))
    assert calibration.calibrate(default.cfg, default.model, default.device) is None
    assert cm.decode_step_s(64, 64 * 2048) != pytest.approx(default.decode_step_s(64, 64 * 2048), rel=0.01)
    assert cm.train_step_s([4096] * 64, 8) != pytest.approx(default.train_step_s([4096] * 64, 8), rel=0.01)


def test_a_cost_model_is_handed_the_calibrated_constants_and_never_calibrates_itself():
    cfg = load_config(overrides=[f"model={MODEL}", "costs.profile=example-h800"])
    model, device = specs.model(MODEL), specs.device(DEVICE)
    with pytest.raises(ValueError, match=r"costs.profile='example-h800' is set but no calibrated constants"):
        CostModel(cfg, model, device)
    cm, cal = calibrated_cost_model(cfg, model, device)
    assert cm.cfg.costs == cal.costs(cfg.costs)
    assert cm.terms == CostModel(cfg, model, device, cal.costs(cfg.costs)).terms


def test_provenance_names_fitted_and_kept_constants():
    record = calibrated("example-h800")[1].to_dict()
    assert (record["profile"], record["device"], record["model"]) == ("example-h800", "h800", "qwen3-8b")
    assert record["fitted_to"] == ["qwen3-8b", "qwen3-32b"]
    assert set(record["fitted"]) == {"hbm_efficiency", "decode_layer_overhead_s", "prefill_mfu", "train_mfu"}
    assert "bind it only from below" in record["kept"]["decode_mfu"]["why"]  # every decode point is memory-bound
    assert record["kept"]["decode_mfu"]["value"] == 0.45  # the config's, above the bound the points set
    assert record["kept"]["decode_step_overhead_s"]["value"] == 0.0  # the per-layer overhead replaces it
    assert record["points"] == {"decode": 11, "prefill": 3, "train": 2, "logprob": 0}
    assert record["kept"]["logprob_mfu"] == {"value": 0.5, "why": "no log-prob points"}
    assert record["measured"] == {}  # the example names no copy bandwidth
    assert set(record["rms_relative_error_by_model"]) == {"qwen3-8b", "qwen3-32b"}


def test_a_calibrated_run_records_its_calibration_in_the_timeline():
    from sim.runner import simulate

    overrides = [f"model={MODEL}", "costs.profile=example-h800", "num_steps=1", "cluster.num_gpus=8",
                 "rollout.tensor_parallel=1", "workload.prompts_per_step=8"]  # fmt: skip
    timeline = simulate(load_config(overrides=overrides), "colocated")
    assert timeline.meta["calibration"] == calibrated("example-h800")[1].to_dict()
    assert "calibration" not in simulate(load_config(overrides=overrides[:1] + overrides[2:]), "colocated").meta


def test_points_that_cannot_separate_bandwidth_from_overhead_keep_the_overheads(tmp_path):
    """qwen3-32b alone on one GPU: every decode point reads about the same 65 GB of weights, so the per-layer
    costs are not pinned down; they and the per-step overhead keep the config's values."""
    example = read_profile("example-h800")
    path = write_profile(Profile(1, example.device, (example.model("qwen3-32b"),)), tmp_path / "32b.yaml")
    _, cal = calibrated(path, "model=qwen3-32b")
    assert "decode_layer_overhead_s" not in cal.fitted and "hbm_efficiency" in cal.fitted
    assert "do not pin it down" in cal.kept["decode_layer_overhead_s"]
    assert cal.constants["decode_step_overhead_s"] == load_config().costs.decode_step_overhead_s  # the config's
    assert cal.kept["train_mfu"] == "no training points"


def test_a_part_with_too_few_points_keeps_its_constants(tmp_path):
    profile = roofline_profile(TRUTH, models=(MODEL,))
    entry = profile.models[0]
    thin = ModelProfile(MODEL, decode=entry.decode[:2], prefill=(), train=entry.train)
    _, cal = calibrated(write_profile(Profile(1, profile.device, (thin,)), tmp_path / "thin.yaml"))
    assert set(cal.fitted) == {"hbm_efficiency", "train_mfu", "train_layer_host_s", "train_attention_mfu"}
    assert cal.kept["decode_ctx_latency_s"] == "2 decode point(s) do not pin down 5 constant(s)"
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
    assert calibration.calibrate(cfg, model, specs.device("h800")) is not None
    assert calibration.calibrate(cfg, model, specs.device("h20")) is None


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


def test_a_profile_of_no_known_model_is_refused(tmp_path):
    profile = roofline_profile(TRUTH, models=(MODEL,))
    unknown = Profile(1, profile.device, (dataclasses.replace(profile.models[0], model="tiny"),))
    message = profile_error("model=qwen3-4b", f"costs.profile={write_profile(unknown, tmp_path / 'tiny.yaml')}")
    assert message.startswith("costs.profile: profile ") and "measured no model whose architecture is known" in message
    assert "(it has tiny)" in message


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


def test_the_shipped_h200_profile_is_fitted_with_one_set_of_constants():
    """sim/configs/profiles/h200-torch.yaml (one H200, plain torch, five Qwen3 models): one set of constants
    fits every model's decode within 5% and training within 8% (RMS); prefill and log-probs within 21% and 19%,
    the worst the 512-token points that the host's launches bind, which two runs on the machine measured up to
    1.7x apart (README "GPU calibration"). The default config's comments quote these fits."""
    cfg = load_config(overrides=["model=qwen3-8b", "cluster.device=h200", "costs.profile=h200-torch"])
    cal = calibration.calibrate(cfg, specs.model("qwen3-8b"), specs.device("h200"))
    assert cal.models == ("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "qwen3-14b", "qwen3-32b")
    for model, errors in cal.rms_error_by_model.items():
        assert errors["decode"] < 0.05 and errors.get("train", 0) < 0.08, model
        assert errors["prefill"] < 0.21 and errors["logprob"] < 0.19, model
    assert cal.constants["hbm_efficiency"] == pytest.approx(0.86, abs=0.01) and "copy" in cal.measured["hbm_efficiency"]
    assert cal.constants["kv_hbm_efficiency"] == pytest.approx(0.49, abs=0.02)
    assert cal.constants["decode_layer_overhead_s"] == pytest.approx(1.45e-4, rel=0.05)
    assert cal.constants["decode_ctx_latency_s"] == pytest.approx(1.76e-8, rel=0.05)
    assert cal.constants["train_layer_host_s"] == pytest.approx(4.1e-3, rel=0.05)
    assert set(cal.fitted) >= {"decode_mfu", "decode_seq_layer_overhead_s", "prefill_attention_mfu",
                               "logprob_attention_mfu", "prefill_layer_host_s", "logprob_layer_host_s"}  # fmt: skip
