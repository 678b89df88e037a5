"""/v1/chat/completions answers: message or chunks with reasoning_content and tool_calls."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from aiohttp import web

from strata.engine.api import sse
from strata.engine.api.chat_output import ChatOutput
from strata.engine.text.reasoning import Reasoning
from strata.engine.text.tool_calls import CallStart, TextPiece

log = logging.getLogger(__name__)


def finish_reason(output: ChatOutput) -> str | None:
    """tool_calls when the model called tools (and was not cut off), else the generation's."""
    reason = output.generation.finish_reason
    return "tool_calls" if output.has_calls and reason != "length" else reason


async def chat_response(output: ChatOutput, head: dict, usage) -> web.Response:
    """The whole chat.completion object."""
    try:
        result = await output.collect()
    finally:
        await output.generation.close()
    # refusal is required by OpenAI's schema; a local model never refuses through this field.
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
    choice = {"index": 0, "message": message, "logprobs": None,
              "finish_reason": finish_reason(output)}
    return web.json_response({**head, "object": "chat.completion", "choices": [choice],
                              "usage": usage(output.generation.usage)})


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


async def chat_stream(request: web.Request, output: ChatOutput, head: dict,
                      include_usage: bool, usage) -> web.StreamResponse:
    """chat.completion.chunk events, then [DONE]; a failure ends with an error event."""
    from strata.engine.api.openai_routes import send_stream_error

    response = await sse.open_stream(request)
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(delta: dict, reason: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                     "finish_reason": reason}]}

    try:
        await sse.send_data(response, chunk({"role": "assistant", "content": ""}))
        async with contextlib.aclosing(output.pieces()) as pieces:
            async for piece in pieces:
                await sse.send_data(response, chunk(_delta(piece, output)))
        await sse.send_data(response, chunk({}, finish_reason(output)))
        if include_usage:
            await sse.send_data(response, {**head, "choices": [],
                                           "usage": usage(output.generation.usage)})
        await sse.send_data(response, "[DONE]")
    except ConnectionError:
        log.info("client went away during %s; generation cancelled", request.path)
    except Exception as exc:  # noqa: BLE001 - logged there; the stream must end with an event
        await send_stream_error(request, response, exc)
    finally:
        await output.generation.close()
    return response
