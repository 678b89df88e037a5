"""GPT-OSS's Harmony format: the output split into reasoning, answer text and tool calls.

A Harmony output is a run of messages, each a header and a body:
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`,
a call being `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`
(the generation prompt ends in `<|start|>assistant`, so the first header has no role).
Channel `analysis` is reasoning, `final` the answer, `commentary` without a recipient a preamble
shown as text; any message with a `to=` recipient is a tool call. `<|return|>` and `<|call|>`
end the generation; `<|end|>` ends one message only, so it must not stop generation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tokenizers import Tokenizer

from strata.engine.text.reasoning import Reasoning
from strata.engine.text.tool_calls import CallArguments, CallStart, TextPiece, merged_pieces

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CONSTRAIN, CALL, RETURN = "<|constrain|>", "<|call|>", "<|return|>"
# Structure tokens the parser reads, so the detokenizer shows them although they are special.
SHOWN_TOKENS = (START, CHANNEL, MESSAGE, END, CONSTRAIN)
STOP_TOKENS = (RETURN, CALL)
_BODY_ENDS = (END, CALL, RETURN, START)  # START: a model that skipped <|end|>
_MAX_HEADER_CHARS = 512  # a "header" this long without <|message|> is no header: show it
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
FUNCTIONS = "functions."
# What ends the analysis and opens the answer, for a server that cuts reasoning at a budget.
CLOSE_ANALYSIS = f"{END}{START}assistant{CHANNEL}final{MESSAGE}"

Event = Reasoning | TextPiece | CallStart | CallArguments


def template_is_harmony(template_source: str | None) -> bool:
    """Whether a chat template writes Harmony messages (gpt-oss)."""
    source = template_source or ""
    return CHANNEL in source and MESSAGE in source


def harmony_token_ids(tokenizer: Tokenizer, eos_ids: Iterable[int]
                      ) -> tuple[tuple[int, ...], frozenset[int]]:
    """(stop ids, shown special ids) for a Harmony model: <|return|> and <|call|> stop it,
    <|end|> does not (it ends the analysis before the answer); the structure tokens show."""
    end_id = tokenizer.token_to_id(END)
    stops = [i for i in eos_ids if i != end_id]
    stops += [i for i in map(tokenizer.token_to_id, STOP_TOKENS) if i is not None]
    shown = frozenset(i for i in map(tokenizer.token_to_id, SHOWN_TOKENS) if i is not None)
    return tuple(dict.fromkeys(stops)), shown


def analysis_is_open(text: str) -> bool:
    """The output (so far) ends inside an analysis message's body."""
    at = text.rfind(MESSAGE)
    if at < 0 or any(marker in text[at:] for marker in _BODY_ENDS):
        return False
    header = text[:at].rsplit(START, 1)[-1]
    channel = _CHANNEL_NAME.search(header)
    return channel is not None and channel.group(1) == "analysis" \
        and _RECIPIENT.search(header) is None


class HarmonyParser:
    """Feed text pieces of a Harmony output; get Reasoning, TextPiece, CallStart and
    CallArguments events in order. With `has_calls` False (no tools offered) a call's body
    comes out as text. `prefix`: header text the prompt already holds (a forced call)."""

    def __init__(self, *, has_calls: bool = True, prefix: str = ""):
        self._has_calls = has_calls
        self._pending = prefix
        self._in_body = False
        self._kind = "text"  # reasoning | text | call: what the current body is
        self._call_index = -1
        self._has_arguments = False
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        """Events for one more piece of the output."""
        self._pending += text
        return merged_pieces(self._run(is_final=False))

    def finish(self) -> list[Event]:
        """Events for whatever was held back when the output ends."""
        events = self._run(is_final=True)
        if self._in_body:
            self._end_body(events)
        elif self._pending.strip() and not _is_header(self._pending):
            events.append(TextPiece(self._pending))  # no Harmony at all: plain text
        self._pending = ""
        return merged_pieces(events)

    def _run(self, is_final: bool) -> list[Event]:
        events: list[Event] = []
        while self._pending:
            if not (self._body(events, is_final) if self._in_body else self._header(events)):
                break
        return events

    def _header(self, events: list[Event]) -> bool:
        at = self._pending.find(MESSAGE)
        if at < 0:
            if len(self._pending) > _MAX_HEADER_CHARS:
                events.append(TextPiece(_plain(self._pending)))
                self._pending = ""
            return False
        header, self._pending = self._pending[:at], self._pending[at + len(MESSAGE):]
        recipient = _RECIPIENT.search(header)
        if recipient is not None and recipient.group(1) == "assistant":
            recipient = None  # a tool's answer addressed to the model, not a call
        channel = _CHANNEL_NAME.search(header)
        self._in_body, self._has_arguments = True, False
        if recipient is not None and self._has_calls:
            name = recipient.group(1)
            self._kind = "call"
            self._call_index, self.num_calls = self.num_calls, self.num_calls + 1
            events.append(CallStart(self._call_index, name.removeprefix(FUNCTIONS)))
        elif channel is not None and channel.group(1) == "analysis" and recipient is None:
            self._kind = "reasoning"
        else:  # final, a commentary preamble, or a channel Harmony does not name
            self._kind = "text"
        return True

    def _body(self, events: list[Event], is_final: bool) -> bool:
        pending = self._pending
        ends = [(at, marker) for marker in _BODY_ENDS if (at := pending.find(marker)) >= 0]
        if ends:
            at, marker = min(ends)
            self._emit(pending[:at], events)
            self._pending = pending[at + len(marker):] if marker != START else pending[at:]
            self._end_body(events)
            return True
        keep = 0 if is_final else _partial_end(pending)
        self._emit(pending[:len(pending) - keep], events)
        self._pending = pending[len(pending) - keep:]
        return False

    def _emit(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        if self._kind == "call":
            self._has_arguments = self._has_arguments or bool(text.strip())
            events.append(CallArguments(self._call_index, text))
        elif self._kind == "reasoning":
            events.append(Reasoning(text))
        else:
            events.append(TextPiece(text))

    def _end_body(self, events: list[Event]) -> None:
        if self._kind == "call" and not self._has_arguments:
            events.append(CallArguments(self._call_index, "{}"))
        self._in_body = False
        self._kind = "text"


def _partial_end(text: str) -> int:
    """Length of the longest end of text that could begin a marker that ends a body."""
    at = text.find("<", max(0, len(text) - max(map(len, _BODY_ENDS)) + 1))
    while at >= 0:
        tail = text[at:]
        if any(marker.startswith(tail) for marker in _BODY_ENDS):
            return len(tail)
        at = text.find("<", at + 1)
    return 0


def _is_header(text: str) -> bool:
    """Text that is (the start of) a message header: cut off by max_tokens, it says nothing."""
    return "<|" in text or any(m.startswith(text) for m in (START, CHANNEL))


def _plain(header: str) -> str:
    """Text of something that looked like a header but was not one, markers left out."""
    for marker in (START, CHANNEL, CONSTRAIN):
        header = header.replace(marker, "")
    return header
