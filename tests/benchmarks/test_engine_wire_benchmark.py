"""The engine-wire benchmark: both forms of a call are timed and read back to the same request; bad flags are
one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.engine_wire import as_list, figures
from reference.engine.base import GenerateRequest, SamplingParams
from reference.engine.wire import parse_generate, request_to_wire

ROOT = Path(__file__).resolve().parents[2]


def test_the_listed_call_is_the_packed_one_with_its_prompt_as_a_list():
    request = GenerateRequest("r", (3, 1, 4, 1, 5), SamplingParams(max_tokens=2))
    listed = as_list(request, request_to_wire(request))
    assert listed["prompt_token_ids"] == [3, 1, 4, 1, 5] and "prompt_ids_b64" not in listed
    assert parse_generate(json.loads(json.dumps(listed))) == request


def test_figures_are_cpu_times_and_the_two_bodies_sizes():
    request = GenerateRequest("r", tuple(range(100_000, 102_000)), SamplingParams(max_tokens=2))
    *times, packed, listed = figures(request, reps=2)
    assert all(t >= 0 for t in times)
    assert packed < listed  # 6-digit ids: 4 bytes a token as base64's 5.3 against 8 in a JSON list


def test_a_bad_flag_is_one_line_and_exit_2():
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine_wire", "--reps", "0"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith("--reps must be >= 1, got 0")
