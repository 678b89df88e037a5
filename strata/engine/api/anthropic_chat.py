"""/v1/messages answers: thinking, text and tool_use blocks, whole or as Anthropic's events."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from aiohttp import web

from strata.engine.api import sse
from strata.engine.api.chat_output import ChatOutput, arguments_object
from strata.engine.api.errors import ApiError, error_body
from strata.engine.text.reasoning import Reasoning
from strata.engine.text.tool_calls import CallStart, TextPiece

log = logging.getLogger(__name__)


def stop_reason(output: ChatOutput) -> str:
    """tool_use, max_tokens, stop_sequence or end_turn."""
    generation = output.generation
    if generation.finish_reason == "length":
        return "max_tokens"
    if output.has_calls:
        return "tool_use"
    return "stop_sequence" if generation.stop_sequence is not None else "end_turn"


async def message_response(output: ChatOutput, message: dict, usage) -> web.Response:
    """The whole message object."""
    try:
        result = await output.collect()
    finally:
        await output.generation.close()
    content: list[dict[str, Any]] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text or not result.calls:
        content.append({"type": "text", "text": result.text})
    content += [{"type": "tool_use", "id": c["id"], "name": c["name"],
                 "input": arguments_object(c["arguments"])} for c in result.calls]
    return web.json_response({
        **message, "content": content, "stop_reason": stop_reason(output),
        "stop_sequence": output.generation.stop_sequence,
        "usage": usage(output.generation.usage)})


class _Blocks:
    """Opens and closes content blocks as the kind of piece changes; numbers them."""

    def __init__(self, response: web.StreamResponse):
        self.response = response
        self.index = -1
        self.kind: str | None = None
        self.call_index: int | None = None

    async def send(self, event: str, data: dict) -> None:
        await sse.send_event(self.response, event, {"type": event, **data})

    async def open(self, kind: str, block: dict, call_index: int | None = None) -> None:
        await self.close()
        self.index += 1
        self.kind, self.call_index = kind, call_index
        await self.send("content_block_start", {"index": self.index, "content_block": block})

    async def close(self) -> None:
        if self.kind is not None:
            await self.send("content_block_stop", {"index": self.index})
            self.kind = None

    async def delta(self, delta: dict) -> None:
        await self.send("content_block_delta", {"index": self.index, "delta": delta})

    async def piece(self, piece: Any, output: ChatOutput) -> None:
        if isinstance(piece, Reasoning):
            if self.kind != "thinking":
                await self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            await self.delta({"type": "thinking_delta", "thinking": piece.text})
        elif isinstance(piece, TextPiece):
            if self.kind != "text":
                await self.open("text", {"type": "text", "text": ""})
            await self.delta({"type": "text_delta", "text": piece.text})
        elif isinstance(piece, CallStart):
            await self.open("tool_use", {"type": "tool_use", "id": output.call_ids[piece.index],
                                         "name": piece.name, "input": {}}, piece.index)
        elif self.kind == "tool_use" and piece.index == self.call_index:
            await self.delta({"type": "input_json_delta", "partial_json": piece.text})


async def message_stream(request: web.Request, output: ChatOutput, message: dict,
                         num_prompt_tokens: int, usage, *, text_first: bool
                         ) -> web.StreamResponse:
    """message_start, content blocks, message_delta, message_stop; failures end with an
    `event: error`. text_first opens the text block before the first token (plain chats)."""
    response = await sse.open_stream(request)
    blocks = _Blocks(response)
    try:
        start_usage = {"input_tokens": num_prompt_tokens, "output_tokens": 0,
                       "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
        await blocks.send("message_start", {"message": {
            **message, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": start_usage}})
        if text_first:
            await blocks.open("text", {"type": "text", "text": ""})
        await blocks.send("ping", {})
        async with contextlib.aclosing(output.pieces()) as pieces:
            async for piece in pieces:
                await blocks.piece(piece, output)
        if blocks.index < 0:  # nothing came out: one empty text block, as Anthropic sends
            await blocks.open("text", {"type": "text", "text": ""})
        await blocks.close()
        await blocks.send("message_delta", {
            "delta": {"stop_reason": stop_reason(output),
                      "stop_sequence": output.generation.stop_sequence},
            "usage": usage(output.generation.usage)})
        await blocks.send("message_stop", {})
    except ConnectionError:
        log.info("client went away during /v1/messages; generation cancelled")
    except Exception as exc:
        if not isinstance(exc, ApiError):
            log.error("stream /v1/messages failed", exc_info=exc)
            exc = ApiError(500, "internal server error; the details are in the server log",
                           "internal")
        with contextlib.suppress(ConnectionError):
            await sse.send_event(response, "error", error_body(exc, anthropic=True))
    finally:
        await output.generation.close()
    return response
