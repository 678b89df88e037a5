"""Stored responses of /v1/responses: the conversation behind each id, and its cache slot.

`previous_response_id` continues a stored conversation in the slot it ran in (the engine's
Done.slot), so the follow-up turn's prompt starts with the tokens that slot already holds and
only the new turn is prefilled. A new conversation names no slot: the engine picks the least
recently used idle one, so conversations that alternate keep their caches.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# Enough for many open conversations; each entry holds only text.
MAX_STORED_RESPONSES = 512


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: the whole conversation including its answer, and its slot."""

    messages: tuple[dict[str, str], ...]
    slot: int | None  # the slot the engine ran it in; None if it never got one
    body: dict[str, Any]  # the response object, for GET /v1/responses/{id}


class ResponseStore:
    """In-memory, bounded (oldest dropped first), per server process."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES):
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._max_entries = max_entries

    def get(self, response_id: str) -> StoredResponse | None:
        return self._entries.get(response_id)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
