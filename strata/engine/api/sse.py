"""Server-sent events: the response headers and one framing function per dialect."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


async def open_stream(request: web.Request) -> web.StreamResponse:
    """Send the headers of an event stream; after this, errors must travel as events."""
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream; charset=utf-8",
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",  # proxies such as nginx would otherwise hold chunks back
    })
    await response.prepare(request)
    return response


def _dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


async def send_data(response: web.StreamResponse, payload: Any) -> None:
    """An OpenAI-style event: `data: {...}` (or the literal `data: [DONE]`)."""
    text = payload if isinstance(payload, str) else _dumps(payload)
    await response.write(f"data: {text}\n\n".encode())


async def send_event(response: web.StreamResponse, name: str, payload: Any) -> None:
    """An Anthropic-style named event: `event: NAME` then `data: {...}`."""
    await response.write(f"event: {name}\ndata: {_dumps(payload)}\n\n".encode())
