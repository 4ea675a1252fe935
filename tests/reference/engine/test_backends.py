"""The registry of engine backends: names, configs, the spec's JSON, availability, and what a new entry brings.

A backend registered in this module (`echo`, one config class, one factory, one entry) shows that an entry is
all the runtime needs: the `engine` / `serve` flags, the spec's JSON and the engine process's factory follow.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import FrozenInstanceError, dataclass

import pytest

from core.errors import UserError
from reference.cli import _check_engine_flags, _spec, main, parser
from reference.engine.backends import (
    BACKENDS,
    Backend,
    EngineSpec,
    backend,
    check_available,
    engine_factory,
    option_flags,
    training_backends,
)
from reference.engine.fake import FakeConfig, FakeEngine
from reference.engine.options import check_options, option
from reference.engine.process import engine_argv, make_engine
from reference.engine.vllm_engine import VLLMConfig

SPECS = [
    EngineSpec(),
    EngineSpec(backend="fake", seed=7, max_batch=3, heartbeat_s=0.5, options=FakeConfig(0.01, 4)),
    EngineSpec(backend="vllm", model="/ckpt/ü", coalesce_s=0.002, torch_threads=2, options={"tensor_parallel": 2}),
]


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_entry_names_a_factory_and_a_frozen_config(name):
    entry = backend(name)
    assert callable(engine_factory(name))
    config = entry.config_class()
    with pytest.raises(FrozenInstanceError):
        config.__setattr__("x", 1)
    assert entry.weights_dtype in ("float32", "bfloat16")


def test_an_unknown_backend_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"^unknown engine backend 'sglang'; valid choices: builtin, fake, vllm$"):
        backend("sglang")
    with pytest.raises(ValueError, match="unknown engine backend 'tpu'"):
        EngineSpec(backend="tpu")


def test_training_uses_the_backends_that_load_weights():
    assert training_backends() == ("builtin", "vllm")


def test_the_weights_dtype_is_the_backends():
    assert [EngineSpec(backend=name).weights_dtype for name in ("builtin", "fake", "vllm")] == [
        "float32",
        "float32",
        "bfloat16",
    ]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.backend)
def test_a_spec_survives_its_json(spec):
    assert EngineSpec.from_json(spec.to_json()) == spec


def test_options_given_as_a_mapping_become_the_backends_config():
    assert EngineSpec(backend="vllm", options={"tensor_parallel": 4}).options == VLLMConfig(tensor_parallel=4)
    assert EngineSpec(backend="fake").options == FakeConfig()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: FakeConfig(reply_tokens=0), r"^FakeConfig.reply_tokens must be >= 1, got 0$"),
        (lambda: FakeConfig(token_delay_s=float("nan")), r"^FakeConfig.token_delay_s must be >= 0, got nan$"),
        (lambda: FakeConfig(reply_tokens=2.5), r"^FakeConfig.reply_tokens must be an integer, got 2.5$"),
        (lambda: VLLMConfig(tensor_parallel=True), r"^VLLMConfig.tensor_parallel must be an integer, got True$"),
        (lambda: EngineSpec(backend="fake", options={"tensor_parallel": 2}), r"unknown option 'tensor_parallel' of"),
        (lambda: EngineSpec(backend="builtin", options={"reply_tokens": 2}), r"backend 'builtin'; its options: none"),
        (lambda: EngineSpec(backend="fake", options=VLLMConfig()), r"must be a FakeConfig or a mapping"),
        (lambda: EngineSpec(max_batch=0), r"^max_batch must be an integer >= 1, got 0$"),
        (lambda: EngineSpec(heartbeat_s=0), r"^heartbeat_s must be > 0 seconds, got 0$"),
        (lambda: EngineSpec(logprobs_mode="raw_logits"), r"^logprobs_mode must be one of processed, raw, got 'raw_"),
    ],
)
def test_bad_settings_name_the_value_and_what_is_allowed(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "an engine spec must be a JSON object"),
        ("{", "an engine spec must be a JSON object"),
        ('{"backend": "fake", "token": "x"}', "unknown engine spec field 'token'; its fields: backend, model"),
        ('{"backend": "fake", "options": {"reply_tokens": "4"}}', "FakeConfig.reply_tokens must be an integer"),
    ],
)
def test_a_bad_spec_document_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        EngineSpec.from_json(text)


def test_the_engine_command_line_carries_the_whole_spec_as_one_json_argument():
    spec = SPECS[1]
    argv = engine_argv(spec, "127.0.0.1", 0)
    assert argv[argv.index("--spec-json") + 1] == spec.to_json()
    assert set(json.loads(spec.to_json())) == set(EngineSpec.__dataclass_fields__)
    assert json.loads(spec.to_json())["options"] == {"token_delay_s": 0.01, "reply_tokens": 4}


def test_the_vllm_backend_needs_a_checkpoint_and_its_module():
    with pytest.raises(UserError, match=r"'vllm' needs a local checkpoint directory as its model \(--model DIR\)"):
        check_available("vllm", "default")
    check_available("builtin", "default")
    check_available("fake", "default")
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(UserError, match=r"'vllm' needs NVIDIA GPUs and the gpu extra .*use backend builtin$"):
            check_available("vllm", "/some/checkpoint")


def test_option_flags_come_from_the_configs():
    flags = option_flags()
    assert sorted(flags) == ["--reply-tokens", "--tensor-parallel", "--token-delay-s"]
    assert flags["--reply-tokens"].ranges == {"fake": (1, None)}
    assert flags["--tensor-parallel"].kind is int and flags["--token-delay-s"].kind is float


def test_the_engine_flags_build_the_spec():
    args = parser().parse_args(["engine", "--backend", "fake", "--reply-tokens", "3", "--torch-threads", "1"])
    _check_engine_flags(args)
    assert _spec(args) == EngineSpec(backend="fake", torch_threads=1, options=FakeConfig(reply_tokens=3))


def test_the_logprobs_mode_is_a_flag_of_the_spec(capsys):
    args = parser().parse_args(["engine", "--logprobs-mode", "raw", "--torch-threads", "1"])
    assert _spec(args) == EngineSpec(logprobs_mode="raw", torch_threads=1)
    assert EngineSpec().logprobs_mode == "processed"
    assert EngineSpec.from_json(EngineSpec(logprobs_mode="raw").to_json()).logprobs_mode == "raw"
    with pytest.raises(SystemExit) as ended:
        main(["engine", "--logprobs-mode", "raw_logits"])
    assert ended.value.code == 2
    assert "invalid choice: 'raw_logits' (choose from 'processed', 'raw')" in capsys.readouterr().err


def test_spec_json_on_the_command_line_is_the_whole_spec(capsys):
    spec = SPECS[1]
    assert _spec(parser().parse_args(["engine", "--spec-json", spec.to_json()])) == spec
    assert main(["engine", "--spec-json", spec.to_json(), "--max-batch", "4"]) == 2
    assert "--spec-json carries the whole engine spec; drop --max-batch" in capsys.readouterr().err


def test_an_option_of_another_backend_is_refused(capsys):
    assert main(["engine", "--backend", "fake", "--tensor-parallel", "2"]) == 2
    assert "error: --tensor-parallel is an option of backend vllm, not of fake" in capsys.readouterr().err


# ---- a backend added by one entry ----


@dataclass(frozen=True)
class EchoConfig:
    """A backend's options, declared as every backend declares them."""

    echo_tokens: int = option(3, 1, 64, help="tokens in every reply")

    def __post_init__(self) -> None:
        check_options(self)


def echo_engine(spec: EngineSpec) -> FakeEngine:
    return FakeEngine(vocab_size=50, reply_tokens=spec.options.echo_tokens)


@pytest.fixture
def echo(monkeypatch):
    monkeypatch.setitem(BACKENDS, "echo", Backend(f"{__name__}:echo_engine", EchoConfig, "float32", trains=False))


def test_a_new_entry_brings_its_flags_spec_and_factory(echo, capsys):
    args = parser().parse_args(["engine", "--backend", "echo", "--echo-tokens", "5"])
    _check_engine_flags(args)
    spec = _spec(args)
    assert EngineSpec.from_json(spec.to_json()) == spec
    engine = make_engine(spec)
    assert (type(engine), engine.reply_tokens) == (FakeEngine, 5)
    assert main(["engine", "--backend", "echo", "--echo-tokens", "65"]) == 2
    assert "error: --echo-tokens must be in 1..64, got 65" in capsys.readouterr().err
    assert "echo" not in training_backends()
