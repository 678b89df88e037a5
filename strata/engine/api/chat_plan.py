"""From parsed chat messages, tools and output format to a prompt and how to read the output.

Decides, per request: the prompt (tools rendered by the model's template, or Strata's Hermes
prompt), the grammar the engine enforces (a response format, or a forced tool call), which
tool-call format to parse, and whether reasoning is split out, honouring or refusing (400) a
request for thinking the model's template cannot give.

A last assistant message is a prefill, as on Anthropic's API and llama.cpp's server: the
prompt is the conversation before it with the generation prompt, then its text, so the model
continues that turn instead of answering anew, and the answer holds only the continuation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from strata.engine.api.chat_messages import parse_openai_messages
from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import bad_request
from strata.engine.api.harmony_plan import render_harmony
from strata.engine.api.output_format import openai_output_grammar, openai_thinking
from strata.engine.api.reasoning_effort import TEMPLATE_VARIABLE, openai_reasoning_effort
from strata.engine.api.textgen import render_chat_prompt, text_assets
from strata.engine.api.tool_prompt import (
    call_grammar,
    hermes_messages,
    phi4_messages,
    template_reads_message_tools,
    template_reads_tools,
)
from strata.engine.api.tool_spec import ToolRequest, parse_openai_tools
from strata.engine.text.harmony import template_is_harmony
from strata.engine.text.reasoning import (
    MISTRAL_THINK,
    THINK,
    ThinkTags,
    prompt_opens_thinking,
    template_uses,
    think_tags,
)
from strata.engine.text.tool_calls import detect_format

# Template variables Strata sets itself; chat_template_kwargs may not replace them.
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


@dataclass(frozen=True)
class ChatPlan:
    prompt_ids: list[int]
    grammar: str | None  # llguidance grammar for the engine, or None
    tool_format: str | None  # parse calls in this format; None: the output is all text
    tools: ToolRequest
    thinks: bool  # split think-block reasoning out of the output
    starts_thinking: bool  # the prompt opened the think block
    is_harmony: bool = False  # gpt-oss: channels carry reasoning, answer and calls
    prefill: str = ""  # output already in the prompt (a Harmony header), read first
    think_tags: ThinkTags = THINK  # <think> or Mistral's [THINK]


def template_kwargs(body: dict, source: str | None, param: str = "chat_template_kwargs"
                    ) -> dict[str, Any]:
    """chat_template_kwargs: variables for the template; each must be one the template reads."""
    value = body.get(param)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"'{param}' must be an object", param=param)
    for name in value:
        if name in _RESERVED:
            raise bad_request(f"'{param}' may not set {name!r}; Strata sets it", param=param)
        if not template_uses(source, name):
            raise bad_request(f"'{param}' sets {name!r}, which this model's chat template does "
                              "not use; leave it out", param=param)
    return dict(value)


@dataclass(frozen=True)
class ChatInputs:
    """The parts of a chat body that shape its prompt: render_chat's and plan_chat's input."""
    messages: list[dict[str, Any]]
    tools: ToolRequest = field(default_factory=ToolRequest)
    output_grammar: str | None = None
    thinking: bool | None = None  # None: the template's default
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    thinking_param: str = "enable_thinking"  # the body's field that set `thinking`, for 400s
    effort: str | None = None  # low | medium | high, for a template that reads it
    effort_param: str = "reasoning_effort"  # the body's field that set `effort`, for 400s


def openai_chat_inputs(body: dict, service: Any) -> tuple[ChatInputs, Any]:
    """The prompt-shaping fields of an OpenAI chat body, each checked (a 400 naming it), and
    the service's text assets (a 503 without them), read after the body's own checks so bad
    input is a 400 whatever the service's state. /v1/chat/completions and /apply-template
    both read a body through this: the prompt /apply-template shows is the one chat would
    feed the model, refusals included."""
    tools = parse_openai_tools(body)
    messages = parse_openai_messages(body)  # tool calls and results too
    output_grammar, thinking = openai_output_grammar(body), openai_thinking(body)
    assets = text_assets(service)
    effort = openai_reasoning_effort(body)
    return (ChatInputs(messages, tools, output_grammar, thinking,
                       template_kwargs(body, assets.chat_template), effort=effort), assets)


@dataclass(frozen=True)
class ChatRender:
    """What the chat template gets for one request, and how to read the output."""
    messages: list[dict[str, Any]]  # as rendered: Strata's Hermes text where tools need it
    template_kwargs: dict[str, Any]  # tools (a template that reads them), enable_thinking, ...
    grammar: str | None
    tool_format: str | None
    thinks: bool
    is_harmony: bool = False
    # Text written after the generation prompt: the last assistant message's (a prefill to
    # continue), or the Harmony header a forced format opens.
    prefill: str = ""
    think_tags: ThinkTags = THINK


def mistral_thinking_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as Magistral's / Ministral 3 Reasoning's template reads them: an assistant
    turn's reasoning_content becomes a thinking content part before its text (the template
    writes it back as `[THINK]...[/THINK]`; it reads no reasoning_content)."""
    out = []
    for message in messages:
        reasoning = message.get("reasoning_content")
        if message["role"] != "assistant" or not reasoning:
            out.append(message)
            continue
        turn = {k: v for k, v in message.items() if k != "reasoning_content"}
        parts: list[dict[str, str]] = [{"type": "thinking", "thinking": reasoning}]
        if message.get("content"):
            parts.append({"type": "text", "text": message["content"]})
        turn["content"] = parts
        out.append(turn)
    return out


def split_prefill(messages: list[dict[str, Any]], thinking_param: str
                  ) -> tuple[list[dict[str, Any]], str | None]:
    """(the messages before a prefill, its text), or (messages, None) without one. A prefill
    is a last assistant message without tool calls; one with reasoning is refused (400)."""
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant" or last.get("tool_calls"):
        return messages, None
    if last.get("reasoning_content"):
        raise bad_request("the last assistant message is continued (a prefill) and cannot hold "
                          "reasoning; send its text only", param=thinking_param)
    return messages[:-1], last.get("content") or ""


def render_chat(assets: Any, inputs: ChatInputs) -> ChatRender:
    """The template's input for one chat request (see the module doc), refusing (400) what
    the model's template cannot give; /apply-template shows the same prompt."""
    tools, output_grammar = inputs.tools, inputs.output_grammar
    thinking, thinking_param = inputs.thinking, inputs.thinking_param
    messages, prefill = split_prefill(inputs.messages, thinking_param)
    source = assets.chat_template
    kwargs = dict(inputs.template_kwargs)
    if inputs.effort is not None:
        if not template_uses(source, TEMPLATE_VARIABLE):
            raise bad_request(f"'{inputs.effort_param}' sets a reasoning effort, but this "
                              "model's chat template takes none; leave it out",
                              param=inputs.effort_param)
        kwargs[TEMPLATE_VARIABLE] = inputs.effort
    if template_is_harmony(source):
        if prefill is not None:
            raise bad_request("a last assistant message (a prefill to continue) is not "
                              "supported on a Harmony (gpt-oss) model: its answer opens with "
                              "a channel header; end the messages with a user turn",
                              param="messages")
        if kwargs.get("builtin_tools"):
            raise bad_request("'chat_template_kwargs' sets builtin_tools, but Strata runs no "
                              "built-in tools (browser, python); declare them as function "
                              "tools instead", param="chat_template_kwargs")
        harmony = render_harmony(messages, tools, output_grammar, thinking, thinking_param)
        if tools.tools:
            kwargs["tools"] = [t.as_openai() for t in tools.tools]
        return ChatRender(harmony.messages, kwargs, harmony.grammar,
                          "harmony" if tools.is_active else None, True, True, harmony.prefill)
    fmt = detect_format(source)
    forced = tools.forced_tools
    if forced and output_grammar is not None:
        raise bad_request("a forced tool_choice and a structured output format cannot be "
                          "combined; send one of them", param="tool_choice")
    # A named choice is one call of that tool; required may make several when parallel.
    is_parallel = tools.is_parallel and tools.mode == "required"
    grammar = output_grammar or (call_grammar(fmt, forced, is_parallel) if forced else None)
    if "enable_thinking" in kwargs and thinking is None:
        thinking = bool(kwargs.pop("enable_thinking"))
    tags = think_tags(source)
    thinks = tags is not None
    can_switch = template_uses(source, "enable_thinking")
    if thinking is not None and thinks and can_switch:
        kwargs["enable_thinking"] = thinking
    elif thinking is True and not thinks:
        raise bad_request(f"'{thinking_param}' asks for thinking, but this model does not "
                          "think (its template writes no think block)", param=thinking_param)
    elif thinking is False and thinks:
        raise bad_request(f"'{thinking_param}' turns thinking off, but this model's template "
                          "always thinks", param=thinking_param)
    if prefill and grammar is not None:
        raise bad_request("a last assistant message (a prefill to continue) cannot be combined "
                          "with constrained output (a JSON schema, grammar or forced tool "
                          "call): the grammar starts at the answer's first token; send one "
                          "of them", param="messages")
    # Mistral's reasoning models open [THINK] themselves: output constrained or prefilled from
    # its first token is an answer without reasoning, as their templates allow.
    can_skip = tags == MISTRAL_THINK
    if grammar is not None and thinks:
        if thinking is True or not (can_switch or can_skip):
            raise bad_request("constrained output (a JSON schema, grammar or forced tool call) "
                              "cannot be combined with thinking; turn thinking off",
                              param=thinking_param)
        thinks = False
        if can_switch:
            kwargs["enable_thinking"] = False
    if prefill and thinks:
        # The prefill would land inside an open think block, or before one the model opens.
        if thinking is True or not (can_switch or can_skip):
            raise bad_request("a last assistant message (a prefill to continue) cannot be "
                              "combined with thinking; turn thinking off or end the messages "
                              "with a user turn", param=thinking_param)
        thinks = False
        if can_switch:
            kwargs["enable_thinking"] = False
    thinks = thinks and kwargs.get("enable_thinking") is not False
    rendered = messages
    if tags == MISTRAL_THINK:
        rendered = mistral_thinking_messages(messages)
    if template_reads_message_tools(source):
        rendered = phi4_messages(messages, tools.tools)
    elif template_reads_tools(source):
        if tools.tools:
            kwargs["tools"] = [t.as_openai() for t in tools.tools]
    else:
        rendered = hermes_messages(messages, tools.tools)
    return ChatRender(rendered, kwargs, grammar, fmt if tools.is_active else None, thinks,
                      prefill=prefill or "", think_tags=tags or THINK)


async def plan_chat(app: web.Application, assets: Any, inputs: ChatInputs) -> ChatPlan:
    """The prompt and output handling of one chat request (render_chat's); templates render
    and grammars compile on the app's CPU pool, off the event loop."""
    render = await run_cpu(app, render_chat, assets, inputs)  # a forced call's grammar
    text, prompt_ids = await render_chat_prompt(app, assets, render.messages, render.prefill,
                                                **render.template_kwargs)
    starts_thinking = render.thinks and prompt_opens_thinking(text, render.think_tags)
    return ChatPlan(prompt_ids, render.grammar, render.tool_format, inputs.tools,
                    render.thinks, starts_thinking, render.is_harmony, render.prefill,
                    render.think_tags)
