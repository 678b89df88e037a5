"""Chat requests for a Harmony model (gpt-oss): its template's input and forced output.

The template takes assistant reasoning as `thinking` (kept only before a tool call, as the
template decides) and the tools itself. A model that always reasons cannot turn thinking off.
Constrained output starts the answer past the reasoning: the prompt is prefilled with the
header of the message to write (the final channel for a response format, a call to
`functions.NAME` for a forced tool choice) and the grammar covers only its body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from strata.engine.api.errors import bad_request
from strata.engine.api.grammar import lark_grammar, lark_json, lark_literal
from strata.engine.api.tool_spec import Tool, ToolRequest
from strata.engine.text.harmony import CHANNEL, CONSTRAIN, FUNCTIONS, MESSAGE

FINAL_HEADER = f"{CHANNEL}final{MESSAGE}"
CALL_HEADER = f"{CHANNEL}commentary to={FUNCTIONS}"


@dataclass(frozen=True)
class HarmonyRender:
    messages: list[dict[str, Any]]
    grammar: str | None
    prefill: str  # text after the template's generation prompt; the parser reads it first


def harmony_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as gpt-oss's template reads them: reasoning_content as `thinking`, and an
    assistant call turn with one of content or thinking (the template refuses both)."""
    out = []
    for message in messages:
        if message["role"] != "assistant":
            out.append(message)
            continue
        turn = {k: v for k, v in message.items() if k != "reasoning_content"}
        turn["content"] = turn.get("content") or ""
        reasoning = message.get("reasoning_content")
        if reasoning:
            turn["thinking"] = reasoning
            if turn.get("tool_calls"):
                turn["content"] = ""  # the reasoning is what led to the call
        out.append(turn)
    return out


def render_harmony(messages: list[dict[str, Any]], tools: ToolRequest,
                   output_grammar: str | None, thinking: bool | None,
                   thinking_param: str) -> HarmonyRender:
    """The messages, grammar and prefill of one chat request to a Harmony model."""
    if thinking is False:
        raise bad_request(f"'{thinking_param}' turns thinking off, but this model always "
                          "reasons (Harmony); ask for low reasoning effort instead",
                          param=thinking_param)
    forced = tools.forced_tools
    if forced and output_grammar is not None:
        raise bad_request("a forced tool_choice and a structured output format cannot be "
                          "combined; send one of them", param="tool_choice")
    rendered = harmony_messages(messages)
    if forced:
        return _forced_call(rendered, forced)
    if output_grammar is not None:
        return HarmonyRender(rendered, output_grammar, FINAL_HEADER)
    return HarmonyRender(rendered, None, "")


def _forced_call(messages: list[dict[str, Any]], forced: tuple[Tool, ...]) -> HarmonyRender:
    """One call of a forced tool: the header in the prompt, the arguments by grammar. With
    several tools to choose from, the name and the rest of the header are in the grammar."""
    for tool in forced:  # each alone, so the error names the tool
        lark_grammar(f"start: {lark_json(tool.parameters, 'tools')}", "tools",
                     f"the parameters of tool {tool.name!r}")
    if len(forced) == 1:
        arguments = lark_json(forced[0].parameters, "tools")
        grammar = lark_grammar(f"start: {arguments}\n", "tool_choice", "the forced tool call")
        return HarmonyRender(messages, grammar,
                             f"{CALL_HEADER}{forced[0].name} {CONSTRAIN}json{MESSAGE}")
    # The special tokens by name (bare <|...|>): llguidance's masks treat a quoted literal
    # holding a special token's text inconsistently (the mask allows the token, the parser
    # then refuses it), found by tests/e2e/test_harmony_e2e.py.
    tail = f'{CONSTRAIN} "json" {MESSAGE}'
    calls = " | ".join(f"{lark_literal(t.name + ' ')} {tail} {lark_json(t.parameters, 'tools')}"
                       for t in forced)
    grammar = lark_grammar(f"start: {calls}\n", "tool_choice", "the forced tool call")
    return HarmonyRender(messages, grammar, CALL_HEADER)
