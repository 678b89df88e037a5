"""OpenAI's Responses API: POST /v1/responses (stream and not), GET /v1/responses/{id}.

Text in, reasoning, text (free, or JSON by text.format's schema) and function calls out, with
`instructions`, function tools (through the chat tools' machinery: plan_chat, ChatOutput),
`reasoning.effort` and `previous_response_id`: a follow-up continues the stored conversation
in the cache slot it ran in, so only the new turn is prefilled.
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
from strata.engine.api.chat_messages import tool_call
from strata.engine.api.chat_output import ChatOutput, ChatResult, arguments_object
from strata.engine.api.chat_plan import ChatInputs, plan_chat
from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import ApiError, bad_request
from strata.engine.api.keys import RESPONSES_KEY
from strata.engine.api.model_routing import service_of
from strata.engine.api.responses_params import (
    ResponsesRequest,
    name_tool_results,
    parse_responses,
)
from strata.engine.api.responses_store import MAX_STORED_RESPONSES, StoredResponse
from strata.engine.api.textgen import start_text_generation, text_assets
from strata.engine.api.tool_spec import ToolRequest
from strata.engine.api.validation import read_json_object
from strata.engine.protocol import Usage
from strata.engine.text.reasoning import Reasoning
from strata.engine.text.tool_calls import CallArguments, CallStart, TextPiece

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


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": status}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str,
               status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _tools_echo(tools: ToolRequest) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t.name, "description": t.description,
             "parameters": t.parameters, "strict": False} for t in tools.tools]


def _choice_echo(tools: ToolRequest) -> Any:
    return {"type": "function", "name": tools.named} if tools.mode == "named" else tools.mode


class _Response:
    """The response object as it grows: in progress, then completed or incomplete."""

    def __init__(self, request: web.Request, parsed: ResponsesRequest):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.parsed = parsed
        self.slot: int | None = None  # where the engine ran it, once finished
        tools = parsed.tools
        self.body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": parsed.instructions,
            "max_output_tokens": parsed.params.max_tokens,
            "model": service_of(request).model_id, "output": [],
            "parallel_tool_calls": tools.is_parallel,
            "previous_response_id": parsed.previous_response_id,
            "reasoning": {"effort": parsed.effort, "summary": None},
            "store": parsed.is_stored,
            "temperature": parsed.params.temperature, "text": {"format": parsed.text_format},
            "tool_choice": _choice_echo(tools), "tools": _tools_echo(tools),
            "top_p": parsed.params.top_p, "truncation": "disabled",
            "metadata": parsed.metadata, "completed_at": None}

    @staticmethod
    def item_status(output: ChatOutput) -> str:
        return "incomplete" if output.generation.finish_reason == "length" else "completed"

    def finish(self, output: ChatOutput, items: list[dict[str, Any]]) -> dict[str, Any]:
        self.slot = output.generation.slot
        is_cut = output.generation.finish_reason == "length"
        self.body.update(
            completed_at=None if is_cut else int(time.time()),
            status="incomplete" if is_cut else "completed",
            incomplete_details={"reason": "max_output_tokens"} if is_cut else None,
            output=items, usage=_usage(output.generation.usage))
        return self.body


def _output_items(output: ChatOutput, result: ChatResult) -> list[dict[str, Any]]:
    """The reasoning, the message (when there is text, or nothing else), then each call."""
    status = _Response.item_status(output)
    items = []
    if result.reasoning:
        items.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", result.reasoning, status))
    if result.text.strip() or not result.calls:
        items.append(_message_item(f"msg_{uuid.uuid4().hex}", result.text, status))
    items += [_call_item(f"fc_{uuid.uuid4().hex}", c["id"], c["name"], c["arguments"], status)
              for c in result.calls]
    return items


def _assistant_turn(text: str, calls: list[dict[str, str]], reasoning: str
                    ) -> dict[str, Any]:
    """The answer as the next turn's history: reasoning, text and the calls, as templates
    read them."""
    # Whitespace around calls is no message: the history a client would send back has none.
    message: dict[str, Any] = {"role": "assistant", "content": text if text.strip() else ""}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [tool_call(c["id"], c["name"], arguments_object(c["arguments"]))
                                 for c in calls]
    return message


def _conversation(request: web.Request, parsed: ResponsesRequest
                  ) -> tuple[tuple[dict[str, Any], ...], int | None]:
    """(messages without the instructions, slot) for this turn: the request's slot, else the
    one the previous response ran in, else None (the engine picks)."""
    store = request.app[RESPONSES_KEY]
    history: tuple[dict[str, Any], ...] = ()
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
    return name_tool_results((*history, *parsed.input_messages)), slot


async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses."""
    service = service_of(request)
    body = await read_json_object(request)
    parsed = await run_cpu(request.app, parse_responses, body)  # text.format's grammar
    messages, slot = _conversation(request, parsed)
    system = [{"role": "system", "content": parsed.instructions}] if parsed.instructions else []
    assets = text_assets(service)
    plan = await plan_chat(request.app, assets, ChatInputs(
        [*system, *messages], parsed.tools, parsed.output_grammar, effort=parsed.effort,
        effort_param="reasoning"))
    params = dataclasses.replace(parsed.params, slot=slot)
    generation = await start_text_generation(service, assets, plan.prompt_ids, params,
                                             plan.grammar)
    output = ChatOutput(generation, plan, "call_")
    response = _Response(request, parsed)
    if parsed.params.is_stream:
        return await _stream(request, output, response, messages)
    try:
        result = await output.collect()
    finally:
        await generation.close()
    final = response.finish(output, _output_items(output, result))
    _store(request, response, messages,
           _assistant_turn(result.text, result.calls, result.reasoning))
    return web.json_response(final)


async def input_tokens(request: web.Request) -> web.Response:
    """POST /v1/responses/input_tokens: the prompt's token count for a Responses body
    (instructions, the previous response's turns and tools included)."""
    service = service_of(request)
    body = await read_json_object(request)
    parsed = await run_cpu(request.app, parse_responses, body)
    messages, _ = _conversation(request, parsed)
    system = [{"role": "system", "content": parsed.instructions}] if parsed.instructions else []
    plan = await plan_chat(request.app, text_assets(service), ChatInputs(
        [*system, *messages], parsed.tools, parsed.output_grammar, effort=parsed.effort,
        effort_param="reasoning"))
    return web.json_response({"object": "response.input_tokens",
                              "input_tokens": len(plan.prompt_ids)})


def _store(request: web.Request, response: _Response, messages: tuple[dict[str, Any], ...],
           answer: dict[str, Any]) -> None:
    if response.parsed.is_stored:
        request.app[RESPONSES_KEY].put(response.id, StoredResponse(
            messages=(*messages, answer), slot=response.slot, body=dict(response.body)))


async def get_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{response_id}: a stored response."""
    stored = request.app[RESPONSES_KEY].get(request.match_info["response_id"])
    if stored is None:
        raise ApiError(404, f"no stored response {request.match_info['response_id']!r}",
                       "not_found")
    return web.json_response(stored.body)


class _Items:
    """Output items of a stream, opened and closed as the kind of piece changes, with their
    events in OpenAI's order: a message's item and part added, text deltas, text and part
    and item done; a function call's item added, argument deltas, arguments and item done."""

    def __init__(self, send: Any, output: ChatOutput):
        self.send = send
        self.output = output
        self.items: list[dict[str, Any]] = []  # finished, in output order
        self.open: dict[str, Any] | None = None  # the item receiving pieces
        self.open_text = ""
        self.pending_space = ""  # whitespace between calls opens no message of its own
        self.text = ""
        self.reasoning = ""
        self.calls: list[dict[str, str]] = []

    def _where(self) -> dict[str, Any]:
        assert self.open is not None  # asked only while an item receives pieces
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    async def open_message(self) -> None:
        await self.close()
        self.open, self.open_text = _message_item(f"msg_{uuid.uuid4().hex}", None,
                                                  "in_progress"), ""
        await self.send("response.output_item.added", output_index=len(self.items),
                        item=dict(self.open))
        await self.send("response.content_part.added", **self._where(), content_index=0,
                        part=_text_part(""))

    async def reasoning_piece(self, text: str) -> None:
        self.reasoning += text
        if self.open is None or self.open["type"] != "reasoning":
            await self.close()
            self.open, self.open_text = _reasoning_item(f"rs_{uuid.uuid4().hex}", None,
                                                        "in_progress"), ""
            await self.send("response.output_item.added", output_index=len(self.items),
                            item=dict(self.open))
        self.open_text += text
        await self.send("response.reasoning_text.delta", **self._where(), content_index=0,
                        delta=text)

    async def text_piece(self, text: str) -> None:
        self.text += text
        if self.open is None or self.open["type"] != "message":
            if not (self.pending_space + text).strip():
                self.pending_space += text
                return
            text, self.pending_space = self.pending_space + text, ""
            await self.open_message()
        self.open_text += text
        await self.send("response.output_text.delta", **self._where(), content_index=0,
                        delta=text, logprobs=[])

    async def call_start(self, piece: CallStart) -> None:
        await self.close()
        self.pending_space = ""
        call = {"id": self.output.call_ids[piece.index], "name": piece.name, "arguments": ""}
        self.calls.append(call)
        self.open = _call_item(f"fc_{uuid.uuid4().hex}", call["id"], piece.name, "",
                               "in_progress")
        await self.send("response.output_item.added", output_index=len(self.items),
                        item=dict(self.open))

    async def arguments(self, piece: CallArguments) -> None:
        if self.open is None or self.open["type"] != "function_call":
            return
        self.open["arguments"] += piece.text
        self.calls[-1]["arguments"] += piece.text
        await self.send("response.function_call_arguments.delta", **self._where(),
                        delta=piece.text)

    async def close(self) -> None:
        """Finish the open item with its done events."""
        if self.open is None:
            return
        where, item = self._where(), self.open
        status = _Response.item_status(self.output)
        if item["type"] == "message":
            text = self.open_text
            await self.send("response.output_text.done", **where, content_index=0, text=text,
                            logprobs=[])
            await self.send("response.content_part.done", **where, content_index=0,
                            part=_text_part(text))
            done = _message_item(item["id"], text, status)
        elif item["type"] == "reasoning":
            await self.send("response.reasoning_text.done", **where, content_index=0,
                            text=self.open_text)
            done = _reasoning_item(item["id"], self.open_text, status)
        else:
            await self.send("response.function_call_arguments.done", **where,
                            name=item["name"], arguments=item["arguments"])
            done = {**item, "status": status}
        await self.send("response.output_item.done", output_index=where["output_index"],
                        item=done)
        self.items.append(done)
        self.open = None


async def _stream(request: web.Request, output: ChatOutput, response: _Response,
                  messages: tuple[dict[str, Any], ...]) -> web.StreamResponse:
    """OpenAI's event order: created, in_progress, then each output item's events (_Items),
    completed. A failure after the headers ends with an `error` event and `response.failed`,
    as OpenAI sends them (the SDK yields both, it does not raise)."""
    stream = await sse.open_stream(request)
    sequence = 0

    async def send(kind: str, **payload: Any) -> None:
        nonlocal sequence
        await sse.send_event(stream, kind, {"type": kind, "sequence_number": sequence,
                                            **payload})
        sequence += 1

    items = _Items(send, output)
    try:
        await send("response.created", response=dict(response.body))
        await send("response.in_progress", response=dict(response.body))
        async with contextlib.aclosing(output.pieces()) as pieces:
            async for piece in pieces:
                if isinstance(piece, Reasoning):
                    await items.reasoning_piece(piece.text)
                elif isinstance(piece, TextPiece):
                    await items.text_piece(piece.text)
                elif isinstance(piece, CallStart):
                    await items.call_start(piece)
                elif isinstance(piece, CallArguments):
                    await items.arguments(piece)
        if not any(i["type"] != "reasoning" for i in items.items) and (
                items.open is None or items.open["type"] == "reasoning"):
            # no answer came out: one empty message
            await items.open_message()
        await items.close()
        final = response.finish(output, items.items)
        _store(request, response, messages,
               _assistant_turn(items.text, items.calls, items.reasoning))
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
        await output.generation.close()
    return stream
