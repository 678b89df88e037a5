"""A chat generation's text as typed pieces: reasoning, answer text, tool calls.

The same pieces feed every dialect, streamed or whole: OpenAI's reasoning_content, content and
tool_calls deltas; Anthropic's thinking, text and tool_use blocks; Responses and Ollama items.

A tool call goes out only once its arguments are complete JSON, as one CallStart and one
CallArguments: a call cut off by max_tokens is dropped, never sent half-written. A client
cannot take back what a stream sent, and a call it cannot parse breaks every agent loop (it
cannot be run, and sent back it used to be refused). OpenAI's clients handle the result:
finish_reason `length` with the text so far and no tool_calls (the SDK's parse() raises its
LengthFinishReasonError, LangChain returns a message without calls), where a truncated call
would reach the tool as a JSON error, or be sent back as history nobody can read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from strata.engine.api.chat_plan import ChatPlan
from strata.engine.api.textgen import TextDeltas
from strata.engine.text.harmony import HarmonyParser
from strata.engine.text.reasoning import Answer, Reasoning, ReasoningSplitter
from strata.engine.text.tool_calls import CallArguments, CallStart, TextPiece, ToolCallParser

log = logging.getLogger(__name__)
Piece = Reasoning | TextPiece | CallStart | CallArguments


def is_complete_json(text: str) -> bool:
    """Whether text is one whole JSON value (a call's arguments that may go out)."""
    stripped = text.strip()
    if not stripped or (stripped[0] in "{[" and stripped[-1] not in "}]"):
        return False  # an object or array not closed yet: skip the parse
    try:
        json.loads(stripped)
    except ValueError:
        return False
    return True


@dataclass
class ChatResult:
    """Everything at once, for non-streaming responses."""

    reasoning: str = ""
    text: str = ""
    calls: list[dict[str, str]] = field(default_factory=list)  # id, name, arguments (JSON text)


class ChatOutput:
    """Split a TextGeneration's deltas per its ChatPlan; `pieces()` streams, `collect()` whole."""

    def __init__(self, generation: TextDeltas, plan: ChatPlan, id_prefix: str):
        self.generation = generation
        self._splitter = ReasoningSplitter(starts_inside=plan.starts_thinking,
                                           tags=plan.think_tags) if plan.thinks else None
        self._parser = ToolCallParser(plan.tool_format) \
            if plan.tool_format and not plan.is_harmony else None
        # Harmony's channels carry reasoning, answer and calls alike: one parser for all.
        self._harmony = HarmonyParser(has_calls=plan.tool_format is not None,
                                      prefix=plan.prefill) if plan.is_harmony else None
        self._max_calls = None if plan.tools.is_parallel else 1
        # Mistral's templates refuse a history whose call ids are not 9 alphanumerics.
        self._is_short_id = plan.tool_format == "mistral"
        self._id_prefix = id_prefix
        self.call_ids: list[str] = []  # of the calls that went out, by their index
        self._held: CallStart | None = None  # the call being written, until it is complete
        self._held_arguments = ""

    @property
    def has_calls(self) -> bool:
        return bool(self.call_ids)

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """Pieces in order; call ids are in call_ids[index] once a CallStart went out."""
        async with contextlib.aclosing(self.generation.deltas()) as deltas:
            async for text in deltas:
                for piece in self._split(text, is_final=False):
                    yield piece
        for piece in self._split("", is_final=True):
            yield piece

    def _split(self, text: str, is_final: bool) -> list[Piece]:
        out: list[Piece] = []
        if self._harmony is not None:
            out.extend(self._harmony.finish() if is_final else self._harmony.feed(text))
        else:
            parts = [Answer(text)] if self._splitter is None else (
                self._splitter.finish() if is_final else self._splitter.feed(text))
            for part in parts:
                if isinstance(part, Reasoning):
                    out.append(part)
                elif self._parser is None:
                    out.append(TextPiece(part.text))
                else:
                    out.extend(self._parser.feed(part.text))
            if is_final and self._parser is not None:
                out.extend(self._parser.finish())
        kept = [piece for p in out if self._keep(p) for piece in self._complete_calls(p)]
        if is_final:
            self._drop_held()
        return kept

    def _keep(self, piece: Piece) -> bool:
        if isinstance(piece, TextPiece | Reasoning):
            return bool(piece.text)
        # parallel_tool_calls false: the first call only
        return self._max_calls is None or piece.index < self._max_calls

    def _complete_calls(self, piece: Piece) -> list[Piece]:
        """Text as it comes; a call held back until its arguments are complete JSON, then as
        one CallStart and one CallArguments, numbered among the calls that went out."""
        if isinstance(piece, CallStart):
            self._drop_held()
            self._held, self._held_arguments = piece, ""
            return []
        if isinstance(piece, CallArguments):
            if self._held is None or piece.index != self._held.index:
                return []
            self._held_arguments += piece.text
            if not is_complete_json(self._held_arguments):
                return []
            index = len(self.call_ids)
            self.call_ids.append(uuid.uuid4().hex[:9] if self._is_short_id
                                 else f"{self._id_prefix}{uuid.uuid4().hex[:24]}")
            start, self._held = self._held, None
            return [CallStart(index, start.name), CallArguments(index, self._held_arguments)]
        self._drop_held()
        return [piece]

    def _drop_held(self) -> None:
        if self._held is not None:
            log.info("tool call %r dropped: the output ended before its arguments were "
                     "complete JSON", self._held.name)
            self._held = None

    async def collect(self) -> ChatResult:
        """The whole output, for a non-streaming response."""
        result = ChatResult()
        async for piece in self.pieces():
            if isinstance(piece, Reasoning):
                result.reasoning += piece.text
            elif isinstance(piece, TextPiece):
                result.text += piece.text
            elif isinstance(piece, CallStart):
                result.calls.append({"id": self.call_ids[piece.index], "name": piece.name,
                                     "arguments": ""})
            else:
                result.calls[piece.index]["arguments"] += piece.text
        return result


def arguments_object(arguments: str) -> Any:
    """A call's arguments text as a value (Anthropic's tool_use input); {} when it is cut off."""
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
