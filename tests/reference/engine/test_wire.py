"""The engine protocol's wire format (reference/engine/wire.py): what one end writes, the other reads back."""

from __future__ import annotations

import json

import pytest

from reference.engine.base import (
    EngineError,
    Finished,
    FinishReason,
    GenerateRequest,
    SamplingParams,
    TokenBatch,
    TokenEvent,
)
from reference.engine.wire import (
    HEARTBEAT_LINE,
    error_line,
    finish_line,
    ids_from_wire,
    ids_to_wire,
    loads_strict,
    parse_generate,
    parse_line,
    parse_tagged,
    request_to_wire,
    tagged_line,
    token_fields,
    tokens_line,
)

WHERE = "http://engine"


def test_a_generate_call_reads_back_as_written():
    params = SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, stop_token_ids=(5, 6), seed=11)
    request = GenerateRequest("r1", (1, 2, 3), params)
    assert parse_generate(loads_strict(json.dumps(request_to_wire(request)))) == request


def test_the_prompt_travels_packed_and_an_id_no_vocabulary_has_travels_as_a_list_for_the_engine_to_refuse():
    ids = (0, 1, 151_643, 2**32 - 1)
    assert ids_from_wire(ids_to_wire(ids)) == ids
    wire = request_to_wire(GenerateRequest("r", ids, SamplingParams(max_tokens=4)))
    assert "prompt_token_ids" not in wire and parse_generate(wire).prompt_token_ids == ids
    for bad in ((-1, 5), (2**32, 5)):
        wire = request_to_wire(GenerateRequest("r", bad, SamplingParams(max_tokens=4)))
        assert wire["prompt_token_ids"] == list(bad) and parse_generate(wire).prompt_token_ids == bad


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"request_id": "", "prompt_token_ids": [1]}, "request_id must be a non-empty string"),
        ({"request_id": "r", "prompt_token_ids": [1.0]}, "prompt_token_ids must be a list of integers"),
        ({"request_id": "r"}, "exactly one of prompt_token_ids"),
        ({"request_id": "r", "prompt_token_ids": [1], "prompt_ids_b64": "AQAAAA=="}, "exactly one of"),
        ({"request_id": "r", "prompt_ids_b64": [1]}, "prompt_ids_b64 must be a base64 string, got \\[1\\]"),
        ({"request_id": "r", "prompt_ids_b64": "AQAA!A=="}, "prompt_ids_b64 is not valid base64"),
        ({"request_id": "r", "prompt_ids_b64": "AQAA"}, "4 bytes an id, got 3 bytes"),
        ({"request_id": "r", "prompt_token_ids": [1, True]}, "prompt_token_ids must be a list of integers"),
        ({"request_id": "r", "prompt_token_ids": [1], "params": {"top_k": 3}}, "unknown sampling param 'top_k'"),
        ({"request_id": "r", "prompt_token_ids": [1], "params": {"temperature": "1"}}, "must be a number, got '1'"),
    ],
)
def test_a_malformed_generate_call_names_the_field(body, message):
    with pytest.raises(ValueError, match=message):
        parse_generate(body)


def test_nan_is_not_json():
    with pytest.raises(ValueError, match="NaN is not a number JSON allows"):
        loads_strict('{"params": {"temperature": NaN}}')


def test_stream_lines_read_back_as_written():
    tokens = [TokenEvent(4, -0.5, 2), TokenEvent(9, -1.25, 3)]
    assert parse_line(tokens_line(tokens), WHERE) == TokenBatch([4, 9], [-0.5, -1.25], [2, 3])
    assert parse_line(finish_line(Finished(FinishReason.STOP)), WHERE) == Finished(FinishReason.STOP)
    assert parse_line(HEARTBEAT_LINE, WHERE) is None
    assert parse_tagged(tagged_line(3, token_fields(tokens[:1])), WHERE) == (3, TokenBatch([4], [-0.5], [2]))
    assert parse_tagged(HEARTBEAT_LINE, WHERE) == (None, None)


def test_an_error_line_is_the_requests_fault_or_the_engines():
    with pytest.raises(ValueError, match="prompt too long"):
        parse_line(error_line("prompt too long", "bad_request"), WHERE)
    with pytest.raises(EngineError, match="http://engine: out of memory"):
        parse_line(error_line("out of memory", "engine"), WHERE)
    index, error = parse_tagged(tagged_line(1, json.loads(error_line("no", "bad_request"))), WHERE)
    assert (index, type(error), str(error)) == (1, ValueError, "no")


@pytest.mark.parametrize("raw", [b"not json\n", b"[1]\n", b'{"t": [1], "l": [], "v": [0]}\n', b'{"what": 1}\n'])
def test_an_unreadable_line_fails_the_stream(raw):
    with pytest.raises(EngineError, match="http://engine: "):
        parse_line(raw, WHERE)
