"""Tools into the prompt, and the grammar of a forced call in the model's own format.

A template that reads `tools` renders them itself. One that does not (SmolLM2's) gets the
Hermes-style prompt Qwen2.5's template writes: the tools as JSON in a system message, calls as
<tool_call> blocks, results as <tool_response> blocks in a user turn; the output is then parsed
as Hermes (text/tool_calls.detect_format says so for such templates). Phi-4-mini's template
reads the tools from the system message instead; phi4_messages puts them there.
"""

from __future__ import annotations

import json
from typing import Any

from strata.engine.api.grammar import lark_grammar, lark_json, lark_literal
from strata.engine.api.tool_spec import Tool

MAX_PARALLEL_CALLS = 8  # a forced, parallel choice: enough for any sane request, and a bound

_HERMES_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}"
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


_MESSAGE_TOOLS = ("message['tools']", 'message["tools"]', "message.tools")
# The system prompt of Microsoft's tool examples for Phi-4-mini, for a request without one.
_PHI4_SYSTEM = "You are a helpful assistant with some tools."


def template_reads_message_tools(template_source: str | None) -> bool:
    """Whether a chat template takes the tools from the system message, as a JSON string
    (Phi-4-mini's: `message['tools']` between <|tool|> and <|/tool|>), not from `tools`."""
    source = template_source or ""
    return any(read in source for read in _MESSAGE_TOOLS)


def phi4_messages(messages: list[dict[str, Any]], tools: tuple[Tool, ...]
                  ) -> list[dict[str, Any]]:
    """messages for a template that reads the tools from the system message (Phi-4-mini's):
    the tools there as a JSON list of functions (a system message made for them if there is
    none), each call of the history written after its text as the model writes calls,
    `<|tool_call|>[...]<|/tool_call|>` (the template renders content only); results stay
    `tool` turns, which the template renders itself."""
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content") or ""
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in message["tool_calls"]]
            content += f"<|tool_call|>{json.dumps(calls, ensure_ascii=False)}<|/tool_call|>"
        out.append({"role": message["role"], "content": content})
    if tools:
        listing = json.dumps([t.as_openai()["function"] for t in tools], ensure_ascii=False)
        if not out or out[0]["role"] != "system":
            out.insert(0, {"role": "system", "content": _PHI4_SYSTEM})
        out[0]["tools"] = listing
    return out


def template_reads_tools(template_source: str | None) -> bool:
    """Whether a chat template renders the `tools` variable itself."""
    return "tools" in (template_source or "")


def hermes_messages(messages: list[dict[str, Any]], tools: tuple[Tool, ...]
                    ) -> list[dict[str, str]]:
    """messages with tools, calls and results written out as Hermes-style text."""
    out: list[dict[str, str]] = []
    if tools:
        listing = "".join("\n" + json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
        prompt = _HERMES_PROMPT.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            prompt = f"{messages[0]['content']}\n\n{prompt}"
            messages = messages[1:]
        out.append({"role": "system", "content": prompt})
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": "1"})
            continue
        if role == "assistant" and message.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"]["name"],
                                  "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                      for c in message["tool_calls"]]
            calls = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
            content = f"{content}\n{calls}" if content else calls
        out.append({"role": role, "content": content})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _call_schema(tool: Tool, argument_key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             argument_key: tool.parameters},
            "required": ["name", argument_key], "additionalProperties": False}


def _xml_value(schema: Any) -> str:
    """One GLM argument value: a string property is written raw (no '<', which would open a
    tag), an enum of strings as its literals, anything else as JSON of its schema."""
    schema = schema if isinstance(schema, dict) else {}
    if isinstance(schema.get("enum"), list) and all(isinstance(v, str) for v in schema["enum"]):
        return "(" + " | ".join(lark_literal(v) for v in schema["enum"]) + ")"
    if schema.get("type") == "string" and not ({"const", "pattern", "format"} & set(schema)):
        return "/[^<]*/"
    return lark_json(schema, "tools")


def _xml_call(tool: Tool) -> str:
    """GLM-4.5's XML call of `tool`: its required arguments in order, then each optional one
    or not, every value per its schema."""
    properties = tool.parameters.get("properties") or {}
    required = [k for k in tool.parameters.get("required") or [] if k in properties]
    pairs = []
    for key in [*required, *(k for k in properties if k not in required)]:
        pair = (f"{lark_literal(f'<arg_key>{key}</arg_key>' + chr(10) + '<arg_value>')} "
                f"{_xml_value(properties[key])} {lark_literal('</arg_value>' + chr(10))}")
        pairs.append(pair if key in required else f"({pair})?")
    head = lark_literal(f"<tool_call>{tool.name}\n")
    return f"{head} {' '.join(pairs)} {lark_literal('</tool_call>')}"


def call_grammar(format_name: str, tools: tuple[Tool, ...], is_parallel: bool) -> str:
    """The grammar of one (or, parallel, up to MAX_PARALLEL_CALLS) calls of tools, written the
    way format_name's parser reads them; a 400 naming the tool whose schema cannot be enforced."""
    if format_name == "glm":
        for tool in tools:
            lark_grammar(f"start: {_xml_call(tool)}", "tools",
                         f"the parameters of tool {tool.name!r}")
        more = MAX_PARALLEL_CALLS - 1 if is_parallel else 0
        repeat = f' ("\\n" call){{0,{more}}}' if more else ""
        lark = f"start: call{repeat}\ncall: {' | '.join(_xml_call(t) for t in tools)}\n"
        return lark_grammar(lark, "tool_choice", "the forced tool call")
    key = "parameters" if format_name == "llama3" else "arguments"
    for tool in tools:  # check each tool alone, so the error names it
        lark_grammar(f"start: {lark_json(_call_schema(tool, key), 'tools')}", "tools",
                     f"the parameters of tool {tool.name!r}")
    schemas = [_call_schema(t, key) for t in tools]
    one = lark_json(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, "tools")
    more = MAX_PARALLEL_CALLS - 1 if is_parallel else 0
    if format_name == "hermes":
        call, separator, head, tail = (
            f"{lark_literal('<tool_call>' + chr(10))} {one} {lark_literal(chr(10) + '</tool_call>')}",
            lark_literal("\n"), "", "")
    elif format_name in ("mistral", "phi4"):  # a list (the marker is a special token)
        call, separator, head, tail = one, lark_literal(", "), lark_literal("["), lark_literal("]")
    else:
        call, separator, head, tail = one, lark_literal("; "), "", ""
    repeat = f" ({separator} call){{0,{more}}}" if more else ""
    lark = f"start: {head} call{repeat} {tail}\ncall: {call}\n"
    return lark_grammar(lark, "tool_choice", "the forced tool call")
