"""benchmarks/gpu_calibration.py end to end on the CPU with the tiny model (it asserts what was measured and
written, never how fast), its one-line errors, the shapes it builds, and sim/profile.py's loader on what
it writes and on broken profiles."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import yaml
from transformers import Qwen3ForCausalLM

from benchmarks import gpu_calibration
from benchmarks.gpu_calibration import QUICK, main, qwen3_config, tiny_spec
from core import specs
from core.errors import UserError
from sim.profile import PROFILE_VERSION, load_profile, profile_from_dict

QUICK_ARGS = ["--device", "cpu", "--models", "tiny", "--quick"]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One quick CPU run with the h100 roofline beside it: (exit code, stdout, the profile's path)."""
    out = tmp_path_factory.mktemp("calibration") / "profile.yaml"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main([*QUICK_ARGS, "--device-spec", "h100", "--out", str(out)])
    return rc, printed.getvalue(), out


def test_a_cpu_run_writes_a_profile_the_simulator_loads(measured):
    rc, _, out = measured
    assert rc == 0
    profile = load_profile(out)
    assert profile.version == PROFILE_VERSION
    assert (profile.device.spec, profile.device.torch_device, profile.device.dtype) == ("h100", "cpu", "float32")
    tiny = profile.model("tiny")
    assert [(p.batch, p.context) for p in tiny.decode] == [(b, c) for b in QUICK.batches for c in QUICK.contexts]
    assert [p.tokens for p in tiny.prefill] == list(QUICK.prefill_tokens)
    assert [p.seq_len for p in tiny.train] == list(QUICK.train_lens)
    assert [p.seq_len for p in tiny.logprob] == list(QUICK.train_lens)
    assert all(0 < p.mfu <= 1 for p in (*tiny.train, *tiny.logprob)) and tiny.skipped == ()
    device = profile.device  # the CPU's own peaks; no host link on a CPU
    assert device.decode_mode == "eager" and device.matmul_tflops > 0 and device.copy_gb_s > 0
    assert device.host_to_device_gb_s is None and device.device_to_host_gb_s is None
    assert profile.command.startswith("python -m benchmarks.gpu_calibration --device cpu")


def test_each_measurement_is_printed_beside_the_roofline(measured):
    _, printed, out = measured
    lines = printed.splitlines()
    assert any(line.startswith("tiny: ") and "the h100 roofline (sim/cost.py)" in line for line in lines)
    heads = [line.split()[0] for line in lines if "sim/measured" in line]
    assert heads == ["decode", "prefill", "train", "logprob"]
    assert lines[0].startswith("peaks on ") and lines[1].split()[:2] == ["matrix", "product"]
    rows = [line for line in lines if line.startswith(" " * 10) and line.strip()]
    points = len(QUICK.batches) * len(QUICK.contexts) + len(QUICK.prefill_tokens) + 2 * len(QUICK.train_lens)
    assert len(rows) == points and not any(" - " in row for row in rows)  # a prediction on every row
    assert lines[-1] == f"profile: {out}"


def test_without_a_device_spec_there_is_no_prediction_and_no_mfu(tmp_path, capsys):
    out = tmp_path / "p.yaml"
    assert main([*QUICK_ARGS, "--out", str(out), "--contexts", "8", "--batches", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(" " * 10)]
    assert rows and all(line.split()[-1] == "-" for line in rows)
    profile = load_profile(out)
    assert profile.device.spec is None and all(p.mfu is None for p in profile.model("tiny").train)
    assert [(p.batch, p.context) for p in profile.model("tiny").decode] == [(1, 8)]


def test_parts_measures_only_what_is_named(tmp_path, capsys):
    out = tmp_path / "p.yaml"
    assert main([*QUICK_ARGS, "--parts", "logprob,decode", "--batches", "1", "--contexts", "8", "--out", str(out)]) == 0
    heads = [line.split()[0] for line in capsys.readouterr().out.splitlines() if "sim/measured" in line]
    assert heads == ["decode", "logprob"]
    tiny = load_profile(out).model("tiny")
    assert (len(tiny.decode), len(tiny.prefill), len(tiny.train), len(tiny.logprob)) == (1, 0, 0, 2)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--parts", "decode,optimizer"], "unknown --parts entry 'optimizer'; valid choices: decode, logprob"),
        (["--parts", ""], "unknown --parts entry ''; valid choices: decode, logprob"),
        (["--cuda-graphs"], "--cuda-graphs needs a CUDA device, got --device cpu"),
        (["--models", "qwen9-1b"], "unknown --models entry 'qwen9-1b'; valid choices: "),
        (["--models", "llama-3.1-8b"], "unknown --models entry 'llama-3.1-8b'; valid choices: "),
        (["--device", "tpu"], "unknown --device 'tpu'; valid choices: cpu, cuda, cuda:N"),
        (["--device", "mps"], "--device 'mps': only CPUs and CUDA GPUs are measured"),
        (["--device-spec", "h999"], "--device-spec: unknown device 'h999'; valid choices: "),
        (["--dtype", "int8"], "unknown --dtype 'int8'; valid choices: bfloat16, float16, float32"),
        (["--batches", "0,4"], "--batches must be integers >= 1, got '0,4'"),
        (["--train-lens", "a"], "--train-lens must be integers separated by commas, got 'a'"),
    ],
)
def test_a_bad_name_is_one_line(tmp_path, capsys, args, message):
    argv = ["--device", "cpu", "--models", "tiny", "--quick", "--out", str(tmp_path / "p.yaml"), *args]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"gpu_calibration: error: {message}"), captured.err
    assert not (tmp_path / "p.yaml").exists()


def test_no_cuda_and_an_existing_profile_are_one_line(tmp_path, capsys):
    existing = tmp_path / "p.yaml"
    existing.write_text("keep me")
    assert main([*QUICK_ARGS, "--out", str(existing)]) == 2
    assert (
        capsys.readouterr().err
        == f"gpu_calibration: error: --out {str(existing)!r} exists; pass --overwrite to replace it\n"
    )
    if not torch.cuda.is_available():
        assert main(["--device", "cuda", "--models", "tiny", "--quick", "--out", str(tmp_path / "q.yaml")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "sees no CUDA GPU here; use --device cpu" in err
    assert existing.read_text() == "keep me"


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"])
def test_the_models_are_built_at_the_shipped_shapes(name):
    spec = specs.model(name)
    with torch.device("meta"):  # shapes only: no memory, no init
        model = Qwen3ForCausalLM(qwen3_config(spec))
    assert sum(p.numel() for p in model.parameters()) == spec.params


def test_the_tiny_model_is_the_runtimes_default():
    from reference.model import default_model

    model, _ = default_model()
    assert sum(p.numel() for p in model.parameters()) == tiny_spec().params
    assert qwen3_config(tiny_spec()).to_dict() == model.config.to_dict()


def test_the_device_spec_is_read_off_the_cuda_name():
    cuda = torch.device("cuda", 0)
    assert gpu_calibration.roofline_device(None, "NVIDIA H100 80GB HBM3", cuda).name == "h100"
    assert gpu_calibration.roofline_device(None, "NVIDIA H200", cuda).name == "h200"  # not h20
    assert gpu_calibration.roofline_device(None, "NVIDIA A100-SXM4-80GB", cuda).name == "a100"
    assert gpu_calibration.roofline_device(None, "NVIDIA GeForce RTX 4090", cuda) is None
    assert gpu_calibration.roofline_device("b200", "NVIDIA H100 80GB HBM3", cuda).name == "b200"
    assert gpu_calibration.roofline_device(None, "x86_64", torch.device("cpu")) is None


# ---- sim/profile.py on broken profiles: the error names the key ----

GOOD = {
    "version": 1,
    "device": {"name": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "spec": "h100"},
    "models": [
        {
            "model": "qwen3-8b",
            "decode": [{"batch": 8, "context": 2048, "step_s": 0.0141}],
            "prefill": [{"tokens": 2048, "seconds": 0.105}],
            "train": [{"seq_len": 2048, "tokens_per_s": 9100.0, "mfu": 0.41}],
        }
    ],
}


def _broken(path: str, value) -> dict:
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    *parents, last = path.split(".")
    target = data
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return data


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("version", 2, "version must be 1 (what this simulator reads), got 2"),
        ("device.dtype", KeyError, "device lacks 'dtype' (required: name, dtype)"),
        ("device.gpu", "h100", "device.gpu is not a known key; valid keys: name, dtype, spec"),
        ("device.copy_gb_s", -1, "device.copy_gb_s must be null or a finite number > 0, got -1"),
        ("device.matmul_tflops", "fast", "device.matmul_tflops must be null or a finite number > 0"),
        ("models.0.logprob", [{"seq_len": 8}], "models[0].logprob[0] lacks 'tokens_per_s'"),
        ("models.0.logprob", [{"seq_len": 8, "tokens_per_s": 9.0, "mfu": 2}], "models[0].logprob[0].mfu must be"),
        ("models", [], "models must list at least one model"),
        ("models.0.decode.0.batch", 0, "models[0].decode[0].batch must be an integer >= 1, got 0"),
        ("models.0.decode.0.batch", True, "models[0].decode[0].batch must be an integer >= 1, got True"),
        ("models.0.decode.0.step_s", float("nan"), "models[0].decode[0].step_s must be a finite number > 0"),
        ("models.0.prefill.0.seconds", "fast", "models[0].prefill[0].seconds must be a finite number > 0"),
        ("models.0.train.0.mfu", 1.5, "models[0].train[0].mfu must be null or a number in (0, 1], got 1.5"),
        ("models.0.train.0.tokens_per_s", KeyError, "models[0].train[0] lacks 'tokens_per_s'"),
        ("models.0.trian", [], "models[0].trian is not a known key; valid keys: model, decode"),
        ("models.0.decode", {"batch": 1}, "models[0].decode must be a list"),
    ],
)
def test_a_broken_profile_names_the_key(path, value, message):
    with pytest.raises(UserError) as raised:
        profile_from_dict(_broken(path, value), "profile 'p.yaml'")
    assert str(raised.value).startswith(f"profile 'p.yaml': {message}"), str(raised.value)


def test_profile_files_round_trip_and_name_their_problems(tmp_path):
    good = profile_from_dict(GOOD)
    path = tmp_path / "p.json"
    path.write_text(yaml.safe_dump(good.to_dict()))
    assert load_profile(path) == good and good.model("qwen3-8b").train[0].mfu == 0.41
    with pytest.raises(UserError, match="unknown model in the profile 'qwen3-1.7b'; valid choices: qwen3-8b"):
        good.model("qwen3-1.7b")
    with pytest.raises(UserError, match="does not exist"):
        load_profile(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("version: [1\n")
    with pytest.raises(UserError, match="is not valid YAML or JSON"):
        load_profile(tmp_path / "bad.yaml")


# ---- the graph-capturable decode step ----


def test_a_decode_step_on_device_tensors_gives_the_engines_decode_logits():
    """`decode_step` (what --cuda-graphs captures: tensors in, attending over a longer span masked per
    position) computes the logits of the engine's `decode`, and writes the same KV (to rounding: the longer
    span changes the order of the attention's sums)."""
    from reference.engine.qwen3_forward import Qwen3Runner
    from reference.model import default_model

    model, _ = default_model()
    runner, spec = Qwen3Runner(model), tiny_spec()
    prompts = [[5, 9, 13, 2, 7], [3, 4, 8]]
    caches = [gpu_calibration._cache(spec, 2, 16, torch.float32, torch.device("cpu")) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            for slot, ids in enumerate(prompts):
                runner.prefill(cache, slot, ids)
        expected = runner.decode(caches[0], [11, 12], [5, 3])
        got = runner.decode_step(caches[1], torch.tensor([11, 12]), torch.tensor([5, 3]), span=16, masked=True)
    assert torch.allclose(got.float(), expected, atol=1e-5)
    assert torch.allclose(caches[0].k, caches[1].k, atol=1e-5) and torch.allclose(caches[0].v, caches[1].v, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_writes_a_profile(tmp_path):
    out = tmp_path / "graphs.yaml"
    argv = ["--device", "cuda", "--models", "tiny", "--quick", "--cuda-graphs", "--parts", "decode", "--out", str(out)]
    assert main(argv) == 0
    profile = load_profile(out)
    assert profile.device.decode_mode == "cuda-graphs" and profile.device.host_to_device_gb_s > 0
    assert len(profile.model("tiny").decode) == len(QUICK.batches) * len(QUICK.contexts)


def _profile(step_s: float, prefill_s: float, *, extra_prefill: bool = False, name: str = "NVIDIA H200", **device):
    from sim.profile import DecodePoint, DeviceInfo, ModelProfile, PrefillPoint, Profile

    prefill = [PrefillPoint(512, prefill_s), *([PrefillPoint(8192, 1.0)] if extra_prefill else [])]
    info = DeviceInfo(name=name, dtype="bfloat16", spec="h200", matmul_tflops=device.get("tflops", 780.0))
    model = ModelProfile("qwen3-8b", decode=(DecodePoint(8, 2048, step_s),), prefill=tuple(prefill), skipped=("x",))
    return Profile(PROFILE_VERSION, info, (model,))


def test_the_median_of_several_runs_takes_each_point_by_itself():
    from sim.profile import median_profile

    runs = [
        _profile(0.010, 0.0232, tflops=780),
        _profile(0.011, 0.0360, tflops=791, extra_prefill=True),
        _profile(0.012, 0.0290, tflops=785),
    ]
    merged = median_profile(runs, command="python -m benchmarks.gpu_calibration --processes 3")
    (entry,) = merged.models
    assert [p.step_s for p in entry.decode] == [0.011]
    assert [(p.tokens, p.seconds) for p in entry.prefill] == [(512, 0.029)]  # the 8192 point: one run of three
    assert "prefill tokens=8192: measured in 1 of 3 runs; not kept" in entry.skipped and "x" in entry.skipped
    assert merged.device.matmul_tflops == 785 and merged.command.endswith("--processes 3")
    assert profile_from_dict(merged.to_dict()) == merged  # an ordinary profile: it round-trips


def test_runs_of_different_devices_have_no_median():
    from sim.profile import median_profile

    with pytest.raises(UserError, match=r"^profile 2 was measured with device name 'NVIDIA H100'.*one setup"):
        median_profile([_profile(0.01, 0.02), _profile(0.01, 0.02, name="NVIDIA H100")])


def test_processes_measures_in_separate_processes_and_writes_the_median(tmp_path, capsys):
    out = tmp_path / "median.yaml"
    argv = [*QUICK_ARGS, "--parts", "prefill", "--prefill-tokens", "8,16", "--processes", "2", "--out", str(out)]
    assert main(argv) == 0
    runs = [load_profile(tmp_path / f"median-run{i}.yaml") for i in (1, 2)]
    merged = load_profile(out)
    for tokens in (8, 16):
        seconds = [p.seconds for run in runs for p in run.model("tiny").prefill if p.tokens == tokens]
        (kept,) = [p.seconds for p in merged.model("tiny").prefill if p.tokens == tokens]
        assert len(seconds) == 2 and kept == pytest.approx(sum(seconds) / 2)  # the median of two
    printed = capsys.readouterr().out
    assert "spread between runs" in printed and f"profile: {out} (each point the median of 2 runs)" in printed
    assert merged.command.endswith("--processes 2 --out " + str(out))
    # again without --overwrite: refused in one line before anything is measured
    assert main(argv) == 2
    assert f"--out {str(out)!r} exists" in capsys.readouterr().err
    out.unlink()
    assert main(argv) == 2
    assert "median-run1.yaml' (a run's own profile beside --out) exists" in capsys.readouterr().err
