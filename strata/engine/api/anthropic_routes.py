"""Anthropic-compatible routes: /v1/messages (stream and not) and /v1/messages/count_tokens."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Any

from aiohttp import web

from strata.engine.api.anthropic_chat import message_response, message_stream
from strata.engine.api.chat_messages import parse_anthropic_messages
from strata.engine.api.chat_output import ChatOutput
from strata.engine.api.chat_plan import ChatInputs, ChatPlan, plan_chat
from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.model_routing import service_of
from strata.engine.api.output_format import anthropic_output_grammar, anthropic_thinking
from strata.engine.api.params import GenerationParams, parse_anthropic, parse_anthropic_system
from strata.engine.api.reasoning_effort import TEMPLATE_VARIABLE, budget_effort
from strata.engine.api.textgen import (
    TextDeltas,
    TextGeneration,
    check_fits_context,
    start_text_generation,
    text_assets,
)
from strata.engine.api.thinking_budget import HARMONY, BudgetedGeneration, thinking_format
from strata.engine.api.tool_spec import parse_anthropic_tools
from strata.engine.api.validation import read_json_object
from strata.engine.protocol import Usage
from strata.engine.text.reasoning import template_uses

log = logging.getLogger(__name__)


async def _plan(request: web.Request, body: dict, *, needs_max_tokens: bool
                ) -> tuple[Any, GenerationParams, ChatPlan]:
    assets = text_assets(service_of(request))
    params = parse_anthropic(body, needs_max_tokens=needs_max_tokens)
    tools = parse_anthropic_tools(body)
    messages = parse_anthropic_messages(body)
    system = parse_anthropic_system(body)
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    thinking = anthropic_thinking(body, params.max_tokens)
    # A template that takes an effort (gpt-oss) gets the budget as one (reasoning_effort.py).
    budget = _thinking_budget(body)
    effort = budget_effort(budget) if budget is not None and template_uses(
        assets.chat_template, TEMPLATE_VARIABLE) else None
    plan = await plan_chat(request.app, assets, ChatInputs(
        messages, tools, await run_cpu(request.app, anthropic_output_grammar, body), thinking,
        thinking_param="thinking", effort=effort, effort_param="thinking"))
    return assets, params, plan


def _usage(usage: Usage) -> dict[str, int]:
    # Anthropic counts cache reads apart: input_tokens is what was not read from the cache.
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages: tools, structured output and thinking included."""
    service = service_of(request)
    body = await read_json_object(request)
    assets, params, plan = await _plan(request, body, needs_max_tokens=True)
    budget = _thinking_budget(body)
    generation: TextDeltas
    if budget is not None and plan.thinks:
        generation = await _budgeted(request, params, plan, budget)
    else:
        generation = await start_text_generation(service, assets, plan.prompt_ids, params,
                                                 plan.grammar)
    output = ChatOutput(generation, plan, "toolu_")
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
               "model": service.model_id}
    if params.is_stream:
        plain = not plan.thinks and plan.tool_format is None
        return await message_stream(request, output, message, len(plan.prompt_ids), _usage,
                                    text_first=plain)
    return await message_response(output, message, _usage)


def _thinking_budget(body: dict) -> int | None:
    """thinking.budget_tokens when thinking is enabled (anthropic_thinking checked it)."""
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":
        return int(thinking["budget_tokens"])
    return None


async def _budgeted(request: web.Request, params: GenerationParams, plan: ChatPlan,
                    budget_tokens: int) -> BudgetedGeneration:
    """A generation whose reasoning ends after budget_tokens (thinking_budget.py)."""
    service = service_of(request)
    assets = text_assets(service)
    max_tokens = check_fits_context(len(plan.prompt_ids), params.max_tokens,
                                    service.context_tokens)
    thinking = HARMONY if plan.is_harmony else thinking_format(plan.think_tags)
    close_ids = list(await run_cpu(request.app, assets.encode, thinking.close_text, False))

    async def start_part(prompt_ids: list[int], num_tokens: int) -> TextGeneration:
        return await start_text_generation(service, assets, prompt_ids,
                                           dataclasses.replace(params, max_tokens=num_tokens),
                                           plan.grammar)

    return await BudgetedGeneration.start(start_part, plan.prompt_ids, budget_tokens,
                                          max_tokens, close_ids, thinking)


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt's token count (tools included)."""
    body = await read_json_object(request)
    _, _, plan = await _plan(request, body, needs_max_tokens=False)
    return web.json_response({"input_tokens": len(plan.prompt_ids)})
