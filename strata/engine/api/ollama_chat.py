"""Ollama's answers to /api/chat and /api/generate: text, `thinking` and `tool_calls` (arguments
as objects), whole or as NDJSON lines, with Ollama's token counts and durations.

The output goes through ChatOutput as on the other dialects; a tool call goes out as one piece
once its arguments are complete, as Ollama sends them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import time
from typing import Any

from aiohttp import web

from strata.engine.api.chat_output import ChatOutput, ChatResult, arguments_object
from strata.engine.api.errors import ApiError
from strata.engine.api.ollama_params import OllamaRequest
from strata.engine.text.reasoning import Reasoning
from strata.engine.text.tool_calls import CallArguments, CallStart, TextPiece

log = logging.getLogger(__name__)


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


class Clock:
    """When the request arrived, for Ollama's total_duration; the parts come from the engine."""

    def __init__(self) -> None:
        self.started_ns = time.monotonic_ns()


def _calls(calls: list[dict[str, str]], first_index: int = 0) -> list[dict[str, Any]]:
    return [{"id": c["id"], "function": {"index": first_index + i, "name": c["name"],
                                         "arguments": arguments_object(c["arguments"])}}
            for i, c in enumerate(calls)]


def _piece(field: str, text: str = "", thinking: str = "",
           calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The `message` (chat) or `response` (generate) part of a line."""
    if field == "message":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}
    return {"response": text, **({"thinking": thinking} if thinking else {})}


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _final(output: ChatOutput, clock: Clock) -> dict[str, Any]:
    """The last line's counts and durations (ns): load and prompt evaluation (until the
    first token) and evaluation (first token to last) as the engine timed them, the total
    from the request's arrival. Clients divide the counts by these."""
    generation = output.generation
    usage = generation.usage
    total_ns = time.monotonic_ns() - clock.started_ns
    if usage is None:  # ended without a count (never reached: deltas() raises first)
        return {"done": True, "done_reason": generation.finish_reason or "stop",
                "total_duration": total_ns}
    # One token has no decode interval; 1 ns keeps eval_count / eval_duration finite.
    eval_ns = max(_ns(usage.decode_s), 1 if usage.completion_tokens else 0)
    return {"done": True, "done_reason": generation.finish_reason or "stop",
            "total_duration": total_ns, "load_duration": _ns(usage.load_s),
            "prompt_eval_count": usage.prompt_tokens,
            "prompt_eval_duration": _ns(usage.prefill_s),
            "eval_count": usage.completion_tokens, "eval_duration": eval_ns}


async def answer_whole(output: ChatOutput, parsed: OllamaRequest, field: str,
                       clock: Clock) -> web.Response:
    try:
        result: ChatResult = await output.collect()
    finally:
        await output.generation.close()
    return web.json_response({
        "model": parsed.model, "created_at": now(),
        **_piece(field, result.text, result.reasoning, _calls(result.calls)),
        **_final(output, clock)})


async def _write_line(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write((json.dumps(payload, ensure_ascii=False) + "\n").encode())


async def answer_stream(request: web.Request, output: ChatOutput, parsed: OllamaRequest,
                        field: str, clock: Clock) -> web.StreamResponse:
    """NDJSON lines; a failure after the headers ends with an `{"error": ...}` line."""
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    head = {"model": parsed.model}
    call: dict[str, str] | None = None  # the call whose arguments are still coming

    async def send(**piece: Any) -> None:
        await _write_line(response, {**head, "created_at": now(), **_piece(field, **piece),
                                     "done": False})

    async def send_call() -> None:
        nonlocal call
        if call is not None:
            await send(calls=_calls([call], int(call["index"])))
            call = None

    try:
        async with contextlib.aclosing(output.pieces()) as pieces:
            async for piece in pieces:
                if isinstance(piece, CallArguments) and call is not None:
                    call["arguments"] += piece.text
                    continue
                await send_call()
                if isinstance(piece, CallStart):
                    call = {"id": output.call_ids[piece.index], "name": piece.name,
                            "arguments": "", "index": str(piece.index)}
                elif isinstance(piece, Reasoning):
                    await send(thinking=piece.text)
                elif isinstance(piece, TextPiece):
                    await send(text=piece.text)
        await send_call()
        await _write_line(response, {**head, "created_at": now(), **_piece(field),
                                     **_final(output, clock)})
    except ConnectionError:
        log.info("client went away during %s; generation cancelled", request.path)
    except ApiError as exc:
        await _write_line(response, {"error": exc.message})
    except Exception:  # the stream must end with an error line
        log.exception("stream %s failed", request.path)
        await _write_line(response, {"error": "internal server error; see the server log"})
    finally:
        await output.generation.close()
    return response
