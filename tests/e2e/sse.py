"""Reading server-sent events off a live aiohttp response, for the raw-HTTP e2e tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str | None, Any]]:
    """(event name or None, data) per event; data is parsed JSON, or the text `[DONE]`."""
    name: str | None = None
    data_lines: list[str] = []
    async for raw in response.content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("event:"):
            name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data_lines.append(line[len("data:"):].strip())
        elif not line and data_lines:
            text = "\n".join(data_lines)
            yield name, (text if text == "[DONE]" else json.loads(text))
            name, data_lines = None, []


def chunk_text(data: Any) -> str:
    """The text of one OpenAI streaming chunk (chat delta or completion text)."""
    if not isinstance(data, dict) or not data.get("choices"):
        return ""
    choice = data["choices"][0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""
