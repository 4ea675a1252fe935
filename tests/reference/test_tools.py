"""Function calling through the manager: Qwen-style tool prompts, parsed tool calls, tool results, and
sessions that stay one token-exact branch across tool turns."""

from __future__ import annotations

import json

import pytest

from reference.engine.fake import ScriptedEngine
from reference.manager.embedded import ManagerThread
from reference.manager.errors import RequestError
from reference.manager.tools import parse_tool_calls, splice_key, tools_system_text, validate_tools

MODEL = "seamlessflow-tiny"
PARAMS = {"type": "object", "properties": {"cmd": {"type": "string"}}}
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a command", "parameters": PARAMS}}


def test_parse_tool_calls():
    text = 'Let me look.\n<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls -la"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me look."
    assert calls[0]["function"] == {"name": "bash", "arguments": '{"cmd": "ls -la"}'}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("plain") == ("plain", [])
    two = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>')
    assert two[0] is None and [c["function"]["name"] for c in two[1]] == ["a", "b"]


def test_splice_key_ignores_ids_and_argument_formatting():
    a = [{"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls", "n": 1}'}}]
    b = [{"id": "call_2", "type": "function", "function": {"name": "bash", "arguments": '{"n":1,"cmd":"ls"}'}}]
    assert splice_key(None, a) == splice_key("", b) != splice_key("", None)


def test_tools_validation_and_system_text():
    with pytest.raises(RequestError, match=r"tools\[0\]"):
        validate_tools([{"type": "function", "function": {}}])
    with pytest.raises(RequestError, match="'tools' must be a list"):
        validate_tools({"bash": 1})
    text = tools_system_text((BASH,), "Be careful.")
    assert text.startswith("Be careful.\n\n# Tools") and json.dumps(BASH) in text and "<tool_call>" in text


def test_tool_call_round_trip_stays_one_branch(tok, tmp_path, openai_client, http):
    call = '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'
    replies = iter([tok.encode(call) + [tok.im_end_id], tok.encode("There is one file.") + [tok.im_end_id]])
    engine = ScriptedEngine(lambda prompt: next(replies), vocab_size=tok.vocab_size)
    with ManagerThread({"s": engine}, tok, tmp_path / "t.sqlite") as m, openai_client(m.base_url("agent")) as client:
        messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "What is here?"}]
        first = client.chat.completions.create(model=MODEL, messages=messages, tools=[BASH])
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.content is None
        assert message.tool_calls[0].function.name == "bash"
        assert json.loads(message.tool_calls[0].function.arguments) == {"cmd": "ls"}
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "a.txt"}]  # fmt: skip
        second = client.chat.completions.create(model=MODEL, messages=messages, tools=[BASH])
        assert second.choices[0].message.content == "There is one file." and second.choices[0].finish_reason == "stop"
        _, tree = http("GET", f"{m.url}/trajectories/agent")
    p1 = engine.consumed[f"{first.model_extra['trajectory']['request_id']}.0"]
    p2 = engine.consumed[f"{second.model_extra['trajectory']['request_id']}.0"]
    ids1 = first.model_extra["trajectory"]["token_ids"]
    assert p2[: len(p1) + len(ids1)] == (*p1, *ids1)  # the tool call was spliced back token for token
    assert tree["num_branches"] == 1
    rendered = tok.decode(list(p2))
    assert "# Tools" in rendered and "<|im_start|>user\n<tool_response>\na.txt\n</tool_response><|im_end|>" in rendered


def test_streamed_tool_calls_arrive_whole(tok, tmp_path, openai_client):
    call = '<tool_call>\n{"name": "bash", "arguments": {"cmd": "pwd"}}\n</tool_call>'
    engine = ScriptedEngine(lambda prompt: tok.encode(call) + [tok.im_end_id], vocab_size=tok.vocab_size)
    with ManagerThread({"s": engine}, tok, tmp_path / "t.sqlite") as m, openai_client(m.base_url("st")) as client:
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "where?"}], tools=[BASH], stream=True
            )
        )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "bash" and calls[0].index == 0
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any("<tool_call>" in (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_tool_choice_required_is_refused(fake_manager, http):
    m, _ = fake_manager()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [BASH], "tool_choice": "required"}
    status, err = http("POST", f"{m.base_url('tc')}/chat/completions", body)
    assert status == 400 and "tool_choice" in err["error"]["message"]
