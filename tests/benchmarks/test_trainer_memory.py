"""The trainer memory benchmark: its mistakes are one line, and on a GPU it measures a step (gpu marker)."""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks import trainer_memory


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--steps", "0"], "--steps >= 1"),
        (["--tokens", "1"], "--tokens >= 2"),
        (["--param-dtype", "bfloat16", "--no-fsdp"], "needs FSDP"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        trainer_memory.main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where no GPU is seen")
def test_cuda_without_a_gpu_names_what_torch_sees(capsys):
    with pytest.raises(SystemExit) as e:
        trainer_memory.main(["--device", "cuda", "--ranks", "1"])
    assert e.value.code == 2
    assert "torch sees 0" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_bf16_fsdp_step_on_a_gpu_is_measured_beside_the_simulator(capsys):
    args = ["--device", "cuda", "--ranks", "1", "--steps", "2", "--layers", "2", "--tokens", "4096"]
    assert trainer_memory.main(args) == 0
    out = capsys.readouterr().out
    peak = float(re.search(r"peak allocated per GPU: ([\d.]+) GB", out).group(1))
    ratio = float(re.search(r"measured / simulated ([\d.]+)", out).group(1))
    assert peak > 0.5 and 0.5 < ratio < 2.0, out
