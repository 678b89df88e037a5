"""Request bodies of OpenAI's Responses API (`POST /v1/responses`) in Strata's native terms.

Fields Strata honours are parsed (function tools, through the chat tools' parser;
structured output in text.format, through the chat formats' constrained decoding; reasoning
effort); fields it cannot honour yet (reasoning summaries, images, hosted tools, background
runs) are a 400 naming the field, never silently dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.engine.api import validation as v
from strata.engine.api.chat_messages import call_arguments, tool_call
from strata.engine.api.errors import bad_request
from strata.engine.api.output_format import responses_output_grammar
from strata.engine.api.params import GenerationParams
from strata.engine.api.reasoning_effort import responses_reasoning_effort
from strata.engine.api.tool_spec import ToolRequest, parse_openai_tools, tool_list

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# Honoured as OpenAI defines them, or carrying no behaviour a local server could have.
_ACCEPTED = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
    "previous_response_id", "store", "metadata", "user", "parallel_tool_calls", "tool_choice",
    "tools", "text", "truncation", "stream_options", "seed", "top_k", "min_p",
    "strata_cache_slot", "id_slot", "reasoning", "include", "background", "service_tier",
})


@dataclass(frozen=True)
class ResponsesRequest:
    """What a /v1/responses request asks for."""

    params: GenerationParams
    instructions: str | None
    input_messages: tuple[dict[str, Any], ...]
    previous_response_id: str | None
    is_stored: bool
    metadata: dict[str, Any]
    tools: ToolRequest
    output_grammar: str | None = None  # text.format json_schema / json_object, compiled
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})  # its echo
    effort: str | None = None  # reasoning.effort, for a template that takes one


def _refuse(body: dict) -> None:
    unknown = sorted(set(body) - _ACCEPTED)
    if unknown:
        raise bad_request(f"{', '.join(map(repr, unknown))} is not supported by Strata's "
                          "Responses API; leave it out", param=unknown[0])
    for name in ("include", "background"):
        if body.get(name):
            raise bad_request(f"{name!r} is not supported by Strata; leave it out", param=name)
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("'truncation' must be 'disabled': Strata does not drop input to fit "
                          "the context", param="truncation")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise bad_request("'service_tier' must be 'auto' or 'default'", param="service_tier")


def parse_responses_tools(body: dict) -> ToolRequest:
    """Responses-shaped function tools ({type, name, description, parameters, strict}) and
    tool_choice ("auto" | "none" | "required" | {type: function, name}), through the chat
    tools' parser. `strict` is accepted: a forced call's arguments are constrained to the
    schema; in auto mode the model's arguments come back as it wrote them."""
    tools = []
    for i, tool in enumerate(tool_list(body)):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        if kind != "function":
            raise bad_request(f"tools[{i}] has type {kind!r}; only 'function' tools are "
                              "supported (no hosted tools on a local server)", param="tools")
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"tools[{i}].strict must be true or false", param="tools")
        tools.append({"type": "function", "function": {
            key: tool.get(key) for key in ("name", "description", "parameters")}})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("'tool_choice' must be 'auto', 'none', 'required' or "
                              "{'type': 'function', 'name': ...}", param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return parse_openai_tools({"tools": tools, "tool_choice": choice,
                               "parallel_tool_calls": body.get("parallel_tool_calls")})


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of text parts",
                          param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where} has a content part of type {kind!r}; only text parts "
                              "are supported", param="input")
        texts.append(part["text"])
    return "\n".join(texts)


def _function_call(item: dict, where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise bad_request(f"{where} (function_call) needs a string {key!r}", param="input")
    return tool_call(item["call_id"], item["name"], call_arguments(item["arguments"], where))


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item sent back: its reasoning_text parts (summaries are not Strata's)."""
    parts = item.get("content") or []
    if not isinstance(parts, list) or not all(
            isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise bad_request(f"{where} (reasoning) must have a list of reasoning_text parts as "
                          "'content'", param="input")
    return "".join(p["text"] for p in parts)


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    return _content_text(output, where)


def parse_input(value: Any) -> tuple[dict[str, Any], ...]:
    """'input': a string (one user message) or a list of items: messages, function_call
    (a call the model made) and function_call_output (its result), as chat templates read
    them: calls on an assistant message, results as `tool` messages."""
    if isinstance(value, str):
        if not value:
            raise bad_request("'input' is empty; send some text", param="input")
        return ({"role": "user", "content": value},)
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a non-empty string or list of messages",
                          param="input")
    messages: list[dict[str, Any]] = []
    reasoning = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind == "reasoning":
            reasoning += _reasoning_text(item, where)
            continue
        if kind == "function_call":
            call = _function_call(item, where)
            if messages and messages[-1]["role"] == "assistant" and not reasoning:
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, ""
            continue
        if kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where} (function_call_output) needs the 'call_id' it "
                                  "answers", param="input")
            messages.append({"role": "tool", "content": _output_text(item.get("output"), where),
                             "tool_call_id": item["call_id"]})
            continue
        if kind != "message":
            raise bad_request(f"{where} is an item of type {kind!r}; only messages, "
                              "reasoning, function_call and function_call_output are "
                              "supported", param="input")
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where} has unknown role {role!r}; use one of "
                              f"{', '.join(_ROLES)}", param="input")
        messages.append({"role": _ROLES[role], "content": _content_text(item.get("content"),
                                                                        where)})
        if reasoning and role == "assistant":
            messages[-1]["reasoning_content"], reasoning = reasoning, ""
    return tuple(messages)


def name_tool_results(messages: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], ...]:
    """Each tool result with the name of the call it answers (templates print it), looked up
    over the whole conversation, earlier turns included."""
    names = {call["id"]: call["function"]["name"]
             for m in messages for call in m.get("tool_calls", ())}
    return tuple({**m, "name": names.get(m["tool_call_id"], "")} if m["role"] == "tool" else m
                 for m in messages)


def parse_responses(body: dict) -> ResponsesRequest:
    """Validate a /v1/responses body; every problem is a 400 naming its field."""
    _refuse(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", param="instructions")
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise bad_request("'previous_response_id' must be a string",
                          param="previous_response_id")
    metadata = v.get_object(body, "metadata")
    output_grammar, text_format = responses_output_grammar(body)
    params = GenerationParams(
        max_tokens=v.get_int(body, "max_output_tokens", None, minimum=1),
        temperature=v.get_temperature(body, maximum=2.0), top_p=v.get_top_p(body),
        top_k=v.get_top_k(body), min_p=v.get_min_p(body), seed=v.get_seed(body), stops=(),
        is_stream=v.get_bool(body, "stream"), include_usage=True, **v.get_cache_slot(body))
    return ResponsesRequest(
        params=params, instructions=instructions, input_messages=parse_input(body.get("input")),
        previous_response_id=previous, is_stored=v.get_bool(body, "store", True),
        metadata=metadata, tools=parse_responses_tools(body), output_grammar=output_grammar,
        text_format=text_format, effort=responses_reasoning_effort(body))
