"""The tools of a request and how it lets the model use them, parsed from OpenAI or Anthropic.

Both dialects become one ToolRequest: the functions (name, description, JSON schema of the
arguments) and a mode: auto (the model decides), none (no calls), required (at least one call,
any tool) or named (one call of that tool). required and named are enforced by constrained
decoding (tool_prompt.call_grammar), so even a small model gives valid calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from strata.engine.api.errors import bad_request

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """The shape chat templates expect for `tools` (Hugging Face's convention)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...] = ()
    mode: str = "auto"  # auto | none | required | named
    named: str | None = None
    is_parallel: bool = True
    names: frozenset[str] = field(default_factory=frozenset)

    @property
    def is_active(self) -> bool:
        """Tools are offered and the model may call them (output gets parsed for calls)."""
        return bool(self.tools) and self.mode != "none"

    @property
    def forced_tools(self) -> tuple[Tool, ...]:
        """The tools a forced call may use (required: all, named: one); () when not forced."""
        if self.mode == "required":
            return self.tools
        if self.mode == "named":
            return tuple(t for t in self.tools if t.name == self.named)
        return ()


def _tool(name: Any, description: Any, parameters: Any, where: str, param: str) -> Tool:
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request(f"{where} needs a 'name' of letters, digits, _ . : - (1-128 chars)",
                          param=param)
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}'s description must be a string", param=param)
    if parameters is None:
        parameters = _EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}'s parameters must be a JSON schema object", param=param)
    return Tool(name, description or "", parameters)


def _unique(tools: list[Tool], param: str) -> frozenset[str]:
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request(f"'{param}' names a tool twice; tool names must be unique", param=param)
    return frozenset(names)


def tool_list(body: dict) -> list:
    """The request's 'tools': a list (absent: empty); each API checks its items."""
    raw = body.get("tools")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list of tools", param="tools")
    return raw


def parse_openai_tools(body: dict) -> ToolRequest:
    """tools, tool_choice and parallel_tool_calls of /v1/chat/completions."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise bad_request(f"'{legacy}' is the deprecated form; send 'tools' and "
                              "'tool_choice' instead", param=legacy)
    tools = []
    for i, item in enumerate(tool_list(body)):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function":
            kind = item.get("type") if isinstance(item, dict) else None
            raise bad_request(f"{where} has type {kind!r}; only 'function' tools are supported",
                              param="tools")
        function = item.get("function")
        if not isinstance(function, dict):
            raise bad_request(f"{where} needs a 'function' object", param="tools")
        tools.append(_tool(function.get("name"), function.get("description"),
                           function.get("parameters"), where, "tools"))
    names = _unique(tools, "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be true or false",
                          param="parallel_tool_calls")
    mode, named = _openai_choice(body.get("tool_choice"), names)
    return ToolRequest(tuple(tools), mode, named, parallel is not False, names)


def _openai_choice(choice: Any, names: frozenset[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("auto", "none", "required"):
        mode, named = choice, None
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)):
        mode, named = "named", choice["function"].get("name")
    else:
        raise bad_request("'tool_choice' must be 'auto', 'none', 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    return _check_choice(mode, named, names)


def _check_choice(mode: str, named: str | None, names: frozenset[str]) -> tuple[str, str | None]:
    if mode in ("required", "named") and not names:
        raise bad_request(f"'tool_choice' is {mode!r} but the request has no tools",
                          param="tool_choice")
    if mode == "named" and named not in names:
        raise bad_request(f"'tool_choice' names {named!r}, which is not among the tools",
                          param="tool_choice")
    return mode, named


def parse_anthropic_tools(body: dict) -> ToolRequest:
    """tools and tool_choice of /v1/messages (custom tools; server tools are refused)."""
    tools = []
    for i, item in enumerate(tool_list(body)):
        where = f"tools[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", param="tools")
        kind = item.get("type")
        if kind not in (None, "custom"):
            raise bad_request(f"{where} has type {kind!r}: server tools are not supported; "
                              "define it as a custom tool with an input_schema", param="tools")
        tools.append(_tool(item.get("name"), item.get("description"), item.get("input_schema"),
                           where, "tools"))
    names = _unique(tools, "tools")
    choice = body.get("tool_choice")
    if choice is None:
        return ToolRequest(tuple(tools), "auto", None, True, names)
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise bad_request("'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'}",
                          param="tool_choice")
    disable_parallel = choice.get("disable_parallel_tool_use")
    if disable_parallel is not None and not isinstance(disable_parallel, bool):
        raise bad_request("'tool_choice.disable_parallel_tool_use' must be true or false",
                          param="tool_choice")
    mode = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}[choice["type"]]
    mode, named = _check_choice(mode, choice.get("name"), names)
    return ToolRequest(tuple(tools), mode, named, not disable_parallel, names)
