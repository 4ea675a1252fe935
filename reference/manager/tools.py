"""OpenAI function calling in Qwen's format (the "hermes" style that Qwen2.5 and Qwen3 are trained on).

A request's `tools` become a block of the system prompt that lists each function as JSON inside
<tools></tools> and asks for calls as {"name", "arguments"} JSON inside <tool_call></tool_call>;
the model's text is parsed back into `tool_calls`; tool results are rendered as a user turn of
<tool_response> blocks. Parsing never changes what is recorded: the trajectory keeps the exact
tokens sampled, and an assistant turn that carries tool calls is spliced back by a key made of its
content and calls (`splice_key`), so the session stays one branch.
"""

from __future__ import annotations

import json
import re
import uuid

from reference.manager.errors import RequestError

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)
CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def validate_tools(tools) -> tuple[dict, ...]:
    """The request's `tools`, checked: each {"type": "function", "function": {"name": str, ...}}."""
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise RequestError(f"'tools' must be a list, got {type(tools).__name__}", param="tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise RequestError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', param="tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string", param="tools")
    return tuple(tools)


def tools_system_text(tools: tuple[dict, ...], system: str | None) -> str:
    """The system message's text when tools are offered (the original system text first)."""
    listing = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    head = f"{system}\n\n" if system else ""
    return head + TOOLS_PREAMBLE + listing + TOOLS_POSTAMBLE


def _arguments_object(arguments):
    """Arguments as an object when they are a JSON string (how OpenAI clients send them back)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def call_text(tool_calls: list[dict]) -> str:
    """How an assistant turn's tool calls read in the prompt (for calls this session did not sample)."""
    blocks = []
    for call in tool_calls:
        function = call.get("function", call) if isinstance(call, dict) else {}
        body = {"name": function.get("name"), "arguments": _arguments_object(function.get("arguments", {}))}
        blocks.append("<tool_call>\n" + json.dumps(body, ensure_ascii=False) + "\n</tool_call>")
    return "\n".join(blocks)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content without the call blocks, or None if nothing is left; OpenAI `tool_calls`). A block that
    is not JSON with a string "name" stays in the content."""
    calls, kept, last = [], [], 0
    for match in CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        arguments = body.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": body["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
    kept.append(text[last:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def splice_key(content: str | None, tool_calls: list[dict] | None) -> str:
    """What identifies an assistant turn for splicing: its content, plus its calls' names and arguments
    (arguments compared as parsed JSON, so re-serialised arguments still match; call ids ignored)."""
    key = content or ""
    for call in tool_calls or ():
        function = call.get("function", call) if isinstance(call, dict) else {}
        arguments = _arguments_object(function.get("arguments", {}))
        key += "\x1f" + str(function.get("name")) + "\x1f" + json.dumps(arguments, sort_keys=True)
    return key
