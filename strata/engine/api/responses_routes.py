"""OpenAI's Responses API: POST /v1/responses (stream and not), GET /v1/responses/{id}.

Text in, text out, with `instructions` and `previous_response_id`: a follow-up continues the
stored conversation in the cache slot it ran in, so only the new turn is prefilled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from strata.engine.api import sse
from strata.engine.api.errors import ApiError, bad_request
from strata.engine.api.keys import RESPONSES_KEY, SERVICE_KEY
from strata.engine.api.responses_params import ResponsesRequest, parse_responses
from strata.engine.api.responses_store import MAX_STORED_RESPONSES, StoredResponse
from strata.engine.api.textgen import (
    TextGeneration,
    encode_chat,
    start_text_generation,
    text_assets,
)
from strata.engine.api.validation import read_json_object
from strata.engine.protocol import Usage

log = logging.getLogger(__name__)


def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    # Every prompt token Strata prefills is written to the slot's KV cache.
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens,
                                     "cache_write_tokens": usage.prompt_tokens
                                     - usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Response:
    """The response object as it grows: in progress, then completed or incomplete."""

    def __init__(self, request: web.Request, parsed: ResponsesRequest):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.parsed = parsed
        self.slot: int | None = None  # where the engine ran it, once finished
        self.body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": parsed.instructions,
            "max_output_tokens": parsed.params.max_tokens,
            "model": request.app[SERVICE_KEY].model_id, "output": [],
            "parallel_tool_calls": True, "previous_response_id": parsed.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": parsed.is_stored,
            "temperature": parsed.params.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": "auto", "tools": [], "top_p": parsed.params.top_p,
            "truncation": "disabled", "metadata": parsed.metadata, "completed_at": None}

    def finish(self, generation: TextGeneration, text: str) -> dict[str, Any]:
        self.slot = generation.slot
        is_cut = generation.finish_reason == "length"
        self.body.update(
            completed_at=None if is_cut else int(time.time()),
            status="incomplete" if is_cut else "completed",
            incomplete_details={"reason": "max_output_tokens"} if is_cut else None,
            output=[_message_item(self.item_id, text, "incomplete" if is_cut else "completed")],
            usage=_usage(generation.usage))
        return self.body


def _conversation(request: web.Request, parsed: ResponsesRequest
                  ) -> tuple[tuple[dict[str, str], ...], int | None]:
    """(messages without the instructions, slot) for this turn: the request's slot, else the
    one the previous response ran in, else None (the engine picks)."""
    store = request.app[RESPONSES_KEY]
    history: tuple[dict[str, str], ...] = ()
    slot = parsed.params.slot
    if parsed.previous_response_id is not None:
        previous = store.get(parsed.previous_response_id)
        if previous is None:
            raise bad_request(f"'previous_response_id' {parsed.previous_response_id!r} was not "
                              "found; this server keeps responses in memory (the last "
                              f"{MAX_STORED_RESPONSES}) until it restarts",
                              param="previous_response_id")
        history = previous.messages
        slot = slot if slot is not None else previous.slot
    return (*history, *parsed.input_messages), slot


async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    service = request.app[SERVICE_KEY]
    body = await read_json_object(request)
    parsed = parse_responses(body)
    messages, slot = _conversation(request, parsed)
    system = [{"role": "system", "content": parsed.instructions}] if parsed.instructions else []
    assets = text_assets(service)
    prompt_ids = await encode_chat(request.app, assets, [*system, *messages])
    params = dataclasses.replace(parsed.params, slot=slot)
    generation = await start_text_generation(service, assets, prompt_ids, params)
    response = _Response(request, parsed)
    if parsed.params.is_stream:
        return await _stream(request, generation, response, messages)
    try:
        text = await generation.collect()
    finally:
        await generation.close()
    final = response.finish(generation, text)
    _store(request, response, messages, text)
    return web.json_response(final)


def _store(request: web.Request, response: _Response, messages: tuple[dict[str, str], ...],
           text: str) -> None:
    if response.parsed.is_stored:
        request.app[RESPONSES_KEY].put(response.id, StoredResponse(
            messages=(*messages, {"role": "assistant", "content": text}), slot=response.slot,
            body=dict(response.body)))


async def get_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{response_id}: a stored response."""
    stored = request.app[RESPONSES_KEY].get(request.match_info["response_id"])
    if stored is None:
        raise ApiError(404, f"no stored response {request.match_info['response_id']!r}",
                       "not_found")
    return web.json_response(stored.body)


async def _stream(request: web.Request, generation: TextGeneration, response: _Response,
                  messages: tuple[dict[str, str], ...]) -> web.StreamResponse:
    """OpenAI's event order: created, in_progress, item and part added, text deltas, the
    matching done events, completed. A failure after the headers ends with an `error` event
    and `response.failed`, as OpenAI sends them (the SDK yields both, it does not raise)."""
    stream = await sse.open_stream(request)
    sequence = 0

    async def send(kind: str, **payload: Any) -> None:
        nonlocal sequence
        await sse.send_event(stream, kind, {"type": kind, "sequence_number": sequence,
                                            **payload})
        sequence += 1

    where = {"item_id": response.item_id, "output_index": 0, "content_index": 0}
    try:
        await send("response.created", response=dict(response.body))
        await send("response.in_progress", response=dict(response.body))
        await send("response.output_item.added", output_index=0,
                   item=_message_item(response.item_id, None, "in_progress"))
        await send("response.content_part.added", **where, part=_text_part(""))
        pieces = []
        async with contextlib.aclosing(generation.deltas()) as deltas:
            async for text in deltas:
                pieces.append(text)
                await send("response.output_text.delta", **where, delta=text, logprobs=[])
        text = "".join(pieces)
        final = response.finish(generation, text)
        await send("response.output_text.done", **where, text=text, logprobs=[])
        await send("response.content_part.done", **where, part=_text_part(text))
        await send("response.output_item.done", output_index=0, item=final["output"][0])
        _store(request, response, messages, text)
        await send(f"response.{final['status']}", response=final)
    except ConnectionError:
        log.info("client went away during /v1/responses; generation cancelled")
    except Exception as exc:  # the stream must end with an event
        if not isinstance(exc, ApiError):
            log.error("stream /v1/responses failed", exc_info=exc)
            exc = ApiError(500, "internal server error; the details are in the server log",
                           "internal")
        failed = {**response.body, "status": "failed",
                  "error": {"code": exc.code, "message": exc.message}}
        with contextlib.suppress(ConnectionError):
            await send("error", code=exc.code, message=exc.message, param=exc.param)
            await send("response.failed", response=failed)
    finally:
        await generation.close()
    return stream
