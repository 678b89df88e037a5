"""/v1/chat/completions answers: message or chunks with reasoning_content, tool_calls,
logprobs, and n choices.

n > 1 choices run one after another on the same cache slot (the later ones reuse the prompt's
K/V) and each draws with its own seed (seed + index); each choice is parsed on its own.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from strata.engine.api import sse
from strata.engine.api.chat_output import ChatOutput
from strata.engine.api.chat_plan import ChatPlan
from strata.engine.api.llama_answer import timings
from strata.engine.api.openai_logprobs import chat_logprobs, summed_usage
from strata.engine.api.textgen import TextGeneration, ended_usage
from strata.engine.text.reasoning import Reasoning
from strata.engine.text.tool_calls import CallStart, TextPiece

log = logging.getLogger(__name__)
StartChoice = Callable[[int], Awaitable[TextGeneration]]


def finish_reason(output: ChatOutput) -> str | None:
    """tool_calls when the model called tools (and was not cut off), else the generation's."""
    reason = output.generation.finish_reason
    return "tool_calls" if output.has_calls and reason != "length" else reason


def _logprobs(output: ChatOutput, params: Any, assets: Any) -> dict | None:
    """The logprob records taken since the last call, in OpenAI's chat shape (None: not asked)."""
    if params.num_logprobs is None:
        return None
    return chat_logprobs(assets, output.generation.take_logprobs())


async def chat_response(start: StartChoice, plan: ChatPlan, params: Any, assets: Any,
                        head: dict, usage, *, verbose: bool = False) -> web.Response:
    """The whole chat.completion object, with its n choices; verbose adds llama-server's
    `__verbose`: the first choice as its /completion answers it, the templated prompt too."""
    choices, usages, native = [], [], {}
    for index in range(params.n):
        output = ChatOutput(await start(index), plan, "call_")
        try:
            result = await output.collect()
        finally:
            await output.generation.close()
        # refusal is required by OpenAI's schema; a local model never refuses through it.
        message: dict[str, Any] = {"role": "assistant",
                                   "content": result.text if result.text or not result.calls
                                   else None, "refusal": None}
        if result.reasoning:
            message["reasoning_content"] = result.reasoning
        if result.calls:
            message["tool_calls"] = [
                {"id": c["id"], "type": "function",
                 "function": {"name": c["name"], "arguments": c["arguments"] or "{}"}}
                for c in result.calls]
        choices.append({"index": index, "message": message,
                        "logprobs": _logprobs(output, params, assets),
                        "finish_reason": finish_reason(output)})
        usages.append(ended_usage(output.generation))
        if verbose and index == 0:
            native = {"__verbose": _native_answer(plan, assets, result.text, usages[0])}
    return web.json_response({**head, "object": "chat.completion", "choices": choices,
                              "usage": usage(summed_usage(usages)), **native})


def _native_answer(plan: ChatPlan, assets: Any, text: str, used: Any) -> dict[str, Any]:
    """A choice in llama-server's /completion terms (its `verbose` debug field)."""
    return {"prompt": assets.decode(plan.prompt_ids, skip_special=False), "content": text,
            "tokens_evaluated": used.prompt_tokens, "tokens_cached": used.cached_tokens,
            "tokens_predicted": used.completion_tokens, "timings": timings(used)}


def _delta(piece: Any, output: ChatOutput) -> dict[str, Any]:
    if isinstance(piece, Reasoning):
        return {"reasoning_content": piece.text}
    if isinstance(piece, TextPiece):
        return {"content": piece.text}
    if isinstance(piece, CallStart):  # OpenAI's first call delta: index, id, type and name
        return {"tool_calls": [{"index": piece.index, "id": output.call_ids[piece.index],
                                "type": "function",
                                "function": {"name": piece.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.text}}]}


async def chat_stream(request: web.Request, start: StartChoice, plan: ChatPlan, params: Any,
                      assets: Any, head: dict, usage) -> web.StreamResponse:
    """chat.completion.chunk events, each choice's tagged with its index, then usage and
    [DONE]; a failure after the headers ends with an error event."""
    from strata.engine.api.openai_routes import end_stream, send_stream_error

    output = ChatOutput(await start(0), plan, "call_")  # fails as JSON before any header
    response = await sse.open_stream(request)
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(index: int, delta: dict, reason: str | None = None,
              logprobs: dict | None = None) -> dict:
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": reason}]}

    usages = []
    try:
        for index in range(params.n):
            if index > 0:
                output = ChatOutput(await start(index), plan, "call_")
            await sse.send_data(response, chunk(index, {"role": "assistant", "content": ""}))
            async with contextlib.aclosing(output.pieces()) as pieces:
                async for piece in pieces:
                    await sse.send_data(response, chunk(index, _delta(piece, output),
                                                        logprobs=_logprobs(output, params,
                                                                           assets)))
            await sse.send_data(response, chunk(index, {}, finish_reason(output),
                                                _logprobs(output, params, assets)))
            usages.append(ended_usage(output.generation))
        await end_stream(response, head, usages if params.include_usage else None, usage)
    except ConnectionError:
        log.info("client went away during %s; generation cancelled", request.path)
    except Exception as exc:  # noqa: BLE001 - logged there; the stream must end with an event
        await send_stream_error(request, response, exc)
    finally:
        await output.generation.close()
    return response
