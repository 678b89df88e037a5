"""Chat histories with tool calls, from OpenAI or Anthropic, in the form chat templates read.

Templates follow Hugging Face's convention: an assistant message has `tool_calls`
([{id, type: function, function: {name, arguments: dict}}]) and results are `role: tool`
messages with `tool_call_id` and `name`; reasoning of earlier turns is `reasoning_content`.
"""

from __future__ import annotations

import json
from typing import Any

from strata.engine.api.errors import bad_request
from strata.engine.api.params import _text_of

_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user",
                 "assistant": "assistant", "tool": "tool"}


def call_arguments(raw: Any, where: str, *, is_lenient: bool = True) -> dict[str, Any] | str:
    """A history call's arguments as templates read them: an object, or, when is_lenient and
    the string is not a JSON object (OpenAI's arguments "may not be valid JSON": a call cut
    off by max_tokens, by any server), that string as it came, for the template to print:
    refusing the client's own history would end its agent loop."""
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):
        value = None
    if isinstance(value, dict):
        return value
    if is_lenient and isinstance(raw, str):
        return raw
    raise bad_request(f"{where} arguments must be a JSON object (as a string)",
                      param="messages")


def tool_call(call_id: str, name: str, arguments: dict | str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _message_objects(body: dict) -> list[tuple[str, dict]]:
    """'messages' of either API as (where, message object) pairs: a non-empty list of objects."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of messages", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object with 'role' and 'content'",
                              param="messages")
    return [(f"messages[{i}]", message) for i, message in enumerate(messages)]


def parse_openai_messages(body: dict) -> list[dict[str, Any]]:
    """/v1/chat/completions 'messages' with tool calls and tool results."""
    parsed: list[dict[str, Any]] = []
    names_by_id: dict[str, str] = {}
    for i, (where, message) in enumerate(_message_objects(body)):
        role = message.get("role")
        if not isinstance(role, str) or role not in _OPENAI_ROLES:
            raise bad_request(f"{where} has unknown role {role!r}; use one of "
                              f"{', '.join(_OPENAI_ROLES)}", param="messages")
        content = _text_of(message.get("content"), where, allow_null=(role == "assistant"))
        out: dict[str, Any] = {"role": _OPENAI_ROLES[role], "content": content}
        if role == "assistant":
            calls = message.get("tool_calls") or []
            if not isinstance(calls, list):
                raise bad_request(f"{where} 'tool_calls' must be a list", param="messages")
            out_calls = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise bad_request(f"{where}.tool_calls[{j}] needs a function with a name",
                                      param="messages")
                call_id = str(call.get("id") or f"call_{i}_{j}")
                names_by_id[call_id] = function["name"]
                out_calls.append(tool_call(call_id, function["name"], call_arguments(
                    function.get("arguments", "{}"), f"{where}.tool_calls[{j}]")))
            if out_calls:
                out["tool_calls"] = out_calls
            if isinstance(message.get("reasoning_content"), str):
                out["reasoning_content"] = message["reasoning_content"]
        elif role == "tool":
            answered_id = message.get("tool_call_id")
            if not isinstance(answered_id, str):
                raise bad_request(f"{where} (role tool) needs the 'tool_call_id' it answers",
                                  param="messages")
            out["tool_call_id"] = answered_id
            out["name"] = names_by_id.get(answered_id, "")
        parsed.append(out)
    return parsed


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content")
    if content is None:
        return ""
    text = _text_of(content, where)
    return f"Error: {text}" if block.get("is_error") is True else text


def parse_anthropic_messages(body: dict) -> list[dict[str, Any]]:
    """/v1/messages 'messages' (text, tool_use, tool_result and thinking blocks) and 'system'."""
    parsed: list[dict[str, Any]] = []
    names_by_id: dict[str, str] = {}
    for where, message in _message_objects(body):
        if message.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where} has unknown role {message.get('role')!r}; use one of "
                              "user, assistant (the system prompt goes in 'system')",
                              param="messages")
        role, content = message["role"], message.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise bad_request(f"{where} content must be a string or a list of blocks",
                              param="messages")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        reasoning: list[str] = []
        for j, block in enumerate(blocks):
            kind = block.get("type") if isinstance(block, dict) else None
            here = f"{where}.content[{j}]"
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                    raise bad_request(f"{here} tool_use needs an 'id' and a 'name'",
                                      param="messages")
                names_by_id[block["id"]] = block["name"]
                calls.append(tool_call(block["id"], block["name"],
                                   call_arguments(block.get("input", {}), here, is_lenient=False)))
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str):
                    raise bad_request(f"{here} tool_result needs the 'tool_use_id' it answers",
                                      param="messages")
                parsed.append({"role": "tool", "content": _tool_result_text(block, here),
                               "tool_call_id": call_id, "name": names_by_id.get(call_id, "")})
            elif kind == "thinking" and role == "assistant":
                reasoning.append(str(block.get("thinking", "")))
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by another provider: nothing a local model can read
            else:
                raise bad_request(f"{here} has a block of type {kind!r} that Strata does not "
                                  "support here; send text, tool_use, tool_result or thinking",
                                  param="messages")
        if role == "user" and not texts and any(m["role"] == "tool" for m in parsed[-1:]):
            continue  # a user turn of tool results only
        out: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            out["tool_calls"] = calls
        if reasoning:
            out["reasoning_content"] = "\n".join(reasoning)
        parsed.append(out)
    return parsed
