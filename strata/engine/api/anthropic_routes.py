"""Anthropic-compatible routes: /v1/messages (stream and not) and /v1/messages/count_tokens."""

from __future__ import annotations

import contextlib
import logging
import uuid
from typing import Any

from aiohttp import web

from strata.engine.api import sse
from strata.engine.api.errors import ApiError, error_body
from strata.engine.api.keys import SERVICE_KEY
from strata.engine.api.params import (
    ANTHROPIC_ROLES,
    GenerationParams,
    parse_anthropic,
    parse_anthropic_system,
    parse_messages,
)
from strata.engine.api.textgen import (
    TextGeneration,
    encode_chat,
    start_text_generation,
    text_assets,
)
from strata.engine.api.validation import read_json_object
from strata.engine.protocol import Usage

log = logging.getLogger(__name__)


async def _prompt_ids(request: web.Request, body: dict, *, needs_max_tokens: bool
                     ) -> tuple[Any, GenerationParams, list[int]]:
    assets = text_assets(request.app[SERVICE_KEY])
    params = parse_anthropic(body, needs_max_tokens=needs_max_tokens)
    messages = parse_messages(body, ANTHROPIC_ROLES)
    system = parse_anthropic_system(body)
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    return assets, params, await encode_chat(request.app, assets, messages)


def _stop_reason(generation: TextGeneration) -> str:
    if generation.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if generation.stop_sequence is not None else "end_turn"


def _usage(usage: Usage) -> dict[str, int]:
    # Anthropic counts cache reads apart: input_tokens is what was not read from the cache.
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    service = request.app[SERVICE_KEY]
    body = await read_json_object(request)
    assets, params, prompt_ids = await _prompt_ids(request, body, needs_max_tokens=True)
    generation = await start_text_generation(service, assets, prompt_ids, params)
    message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
               "model": service.model_id}
    if params.is_stream:
        return await _stream(request, generation, message, len(prompt_ids))
    try:
        text = await generation.collect()
    finally:
        await generation.close()
    return web.json_response({
        **message, "content": [{"type": "text", "text": text}],
        "stop_reason": _stop_reason(generation), "stop_sequence": generation.stop_sequence,
        "usage": _usage(generation.usage)})


async def _stream(request: web.Request, generation: TextGeneration, message: dict,
                  num_prompt_tokens: int) -> web.StreamResponse:
    """The event sequence of Anthropic's streaming API; failures end with `event: error`."""
    response = await sse.open_stream(request)
    send = sse.send_event
    try:
        start_usage = {"input_tokens": num_prompt_tokens, "output_tokens": 0,
                       "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
        await send(response, "message_start", {"type": "message_start", "message": {
            **message, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": start_usage}})
        await send(response, "content_block_start", {
            "type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": ""}})
        await send(response, "ping", {"type": "ping"})
        async with contextlib.aclosing(generation.deltas()) as deltas:
            async for text in deltas:
                await send(response, "content_block_delta", {
                    "type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": text}})
        await send(response, "content_block_stop", {"type": "content_block_stop", "index": 0})
        await send(response, "message_delta", {
            "type": "message_delta",
            "delta": {"stop_reason": _stop_reason(generation),
                      "stop_sequence": generation.stop_sequence},
            "usage": _usage(generation.usage)})
        await send(response, "message_stop", {"type": "message_stop"})
    except ConnectionError:
        log.info("client went away during /v1/messages; generation cancelled")
    except Exception as exc:
        if not isinstance(exc, ApiError):
            log.error("stream /v1/messages failed", exc_info=exc)
            exc = ApiError(500, "internal server error; the details are in the server log",
                           "internal")
        with contextlib.suppress(ConnectionError):
            await send(response, "error", error_body(exc, anthropic=True))
    finally:
        await generation.close()
    return response


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the prompt's token count, without generating."""
    body = await read_json_object(request)
    _, _, prompt_ids = await _prompt_ids(request, body, needs_max_tokens=False)
    return web.json_response({"input_tokens": len(prompt_ids)})
