"""Tool calls parsed out of a model's text, incrementally, in the format of its family.

A parser is fed the text as it streams and returns events: plain text (everything around the
calls is kept), the start of a call (its name, as soon as it is known) and pieces of its
arguments (JSON text, in order, as they arrive). Non-streaming responses feed everything at
once and get the same result. Formats (FORMATS): Hermes `<tool_call>{...}</tool_call>` (Qwen2.5,
Qwen3, and the prompt Strata writes for templates without tools), Llama 3.1+ JSON
(`{"name", "parameters"}`, optionally after `<|python_tag|>`), Mistral `[TOOL_CALLS][{...}]`,
GLM-4.5's XML (`<tool_call>name` then `<arg_key>k</arg_key><arg_value>v</arg_value>` pairs),
Phi-4-mini's `<|tool_call|>[{...}, ...]<|/tool_call|>`, and a generic fallback that takes a
JSON object with a name at the start of the output. A call block that holds no call (not JSON,
or objects without a name) is given back as text whole, its markers included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from strata.engine.text.reasoning import Reasoning

_ARGUMENT_KEYS = ("arguments", "parameters")
_SEPARATORS = " \t\r\n,;[]"


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    text: str  # a piece of the arguments' JSON text


Event = TextPiece | CallStart | CallArguments


@dataclass(frozen=True)
class ToolFormat:
    """How a family writes calls: markers around them, and whether bare JSON at the start of
    the output is a call."""

    name: str
    start: str | None  # text that opens calls
    end: str | None  # text that closes them; None: they run to the end of the output
    json_at_start: bool  # '{' or '[' as the first thing in the output opens calls


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>", False),
    "llama3": ToolFormat("llama3", "<|python_tag|>", None, True),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", None, True),
    "generic": ToolFormat("generic", None, None, True),
    "glm": ToolFormat("glm", "<tool_call>", "</tool_call>", False),
    # Phi-4-mini: a JSON list (llama.cpp's template for it: one object) between its call
    # tokens; bare at the start too, as a client that hides special tokens would see it.
    "phi4": ToolFormat("phi4", "<|tool_call|>", "<|/tool_call|>", True),
}


# Special tokens a format's parser reads: the detokenizer keeps them in the text (Phi-4-mini's
# call tokens are special; hidden, a call would be bare JSON and the text around it ambiguous;
# Mistral's Tekken control tokens hidden, `name[ARGS]{...}` would read as `name{...}`).
SHOWN_TOKENS = {"phi4": ("<|tool_call|>", "<|/tool_call|>"),
                "mistral": ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")}


def detect_format(template_source: str | None) -> str:
    """The call format a chat template teaches its model; hermes when it has no tools."""
    source = template_source or ""
    if "<arg_key>" in source:  # GLM-4.5 / 4.6: <tool_call> too, but XML arguments
        return "glm"
    if "<tool_call>" in source:
        return "hermes"
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|/tool|>" in source or "<|tool_call|>" in source:  # Phi-4-mini's tool tokens
        return "phi4"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3"
    if "tools" not in source:
        return "hermes"  # Strata renders a Hermes-style tool prompt itself (api/tool_prompt.py)
    return "generic"


class _CallObjects:
    """Scans JSON objects (separated by commas, semicolons or whitespace, maybe in a list) and
    turns each with a "name" into call events, streaming its arguments as they arrive."""

    def __init__(self, parser: ToolCallParser):
        self._parser = parser
        self._reset()

    def _reset(self) -> None:
        self.raw = ""  # the current object's text
        self.between = ""  # separators since the last object, given back if text follows
        self.depth = 0
        self.in_string = self.escape = False
        self.key: str | None = None
        self.key_buffer: str | None = None
        self.expect_key = True
        self.value_start: int | None = None  # where the current depth-1 value began in raw
        self.name: str | None = None
        self.index: int | None = None
        self.arguments_at: int | None = None  # start of the arguments value in raw
        self.arguments_sent = 0
        self.arguments_done: str | None = None

    @property
    def is_inside(self) -> bool:
        return self.depth > 0

    def feed_char(self, char: str, events: list[Event]) -> bool:
        """Take one character; False when it cannot belong to the calls (back to text)."""
        if self.depth == 0:
            if char == "{":
                self._reset()
                self.raw, self.depth = "{", 1
                return True
            if char in _SEPARATORS:
                self.between += char
                return True
            return False
        self.raw += char
        if self.in_string:
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
                if self.depth == 1 and self.key_buffer is not None:
                    self.key, self.key_buffer = json.loads(self.key_buffer + '"'), None
                    return True
            if self.key_buffer is not None:
                self.key_buffer += char
            self._stream_arguments(events)
            return True
        if char == '"':
            self.in_string = True
            if self.depth == 1 and self.expect_key:
                self.key_buffer, self.expect_key = '"', False
                return True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
        if self.depth == 1 and char == ":" and self.value_start is None:
            self.value_start = len(self.raw)
            if self.key in _ARGUMENT_KEYS:
                self.arguments_at = self.value_start
        elif (self.depth == 1 and char == ",") or self.depth == 0:
            end = len(self.raw) - 1
            self._end_value(end, events)
            if self.depth == 0:
                self._end_object(events)
                return True
            self.expect_key = True
        self._stream_arguments(events)
        return True

    def _end_value(self, end: int, events: list[Event]) -> None:
        if self.value_start is None:
            return
        text = self.raw[self.value_start:end].strip()
        if self.key == "name" and self.name is None:
            try:
                name = json.loads(text)
            except ValueError:
                name = None
            if isinstance(name, str) and name:
                self.name = name
                self._start_call(events)
        elif self.key in _ARGUMENT_KEYS and self.arguments_done is None:
            self.arguments_done = text
            self._stream_arguments(events)
        self.value_start = None
        self.key = None

    def _start_call(self, events: list[Event]) -> None:
        self.index = self._parser.next_index()
        events.append(CallStart(self.index, self.name))
        self._stream_arguments(events)  # arguments that came before the name

    def _stream_arguments(self, events: list[Event]) -> None:
        if self.index is None or self.arguments_at is None:
            return
        if self.arguments_done is not None:
            text = self.arguments_done
            if text.startswith('"'):  # arguments sent as a JSON string of JSON
                if self.arguments_sent == 0:
                    try:
                        text = json.loads(text)
                    except ValueError:
                        pass
                    events.append(CallArguments(self.index, text))
                    self.arguments_sent = len(self.arguments_done)
                return
            rest = text[self.arguments_sent:]
        else:
            partial = self.raw[self.arguments_at:].lstrip()
            if partial[:1] not in ("{", "["):
                return  # a string or scalar: sent whole when it ends
            lead = len(self.raw[self.arguments_at:]) - len(partial)
            # Hold back the last character: it may be the comma or brace after the value.
            rest = self.raw[self.arguments_at + lead + self.arguments_sent:-1]
        if rest:
            events.append(CallArguments(self.index, rest))
            self.arguments_sent += len(rest)

    def _end_object(self, events: list[Event]) -> None:
        if self.name is None:  # not a call: keep its text
            events.append(TextPiece(self.raw))
        elif self.arguments_done is None:
            events.append(CallArguments(self.index, "{}"))
        self._reset()

    def finish(self, events: list[Event]) -> None:
        """The output ended inside an object: keep it as text unless a call had started."""
        if self.depth > 0 and self.name is None:
            events.append(TextPiece(self.raw))
        self._reset()


class _XmlCall:
    """The inside of one GLM call, `name` then `<arg_key>k</arg_key><arg_value>v</arg_value>`
    pairs (whitespace between): the name is a CallStart as soon as it ends, each pair a piece
    of the arguments' JSON object once its value closes. A value is the JSON it parses as (the
    template writes non-strings with tojson), else a string (written raw)."""

    _KEY, _VALUE = ("<arg_key>", "</arg_key>"), ("<arg_value>", "</arg_value>")

    def __init__(self, parser: ToolCallParser):
        self._parser = parser
        self.between = ""  # the ToolCallParser interface (_CallObjects gives text back)
        self._reset()

    def _reset(self) -> None:
        self.text = ""  # taken and not yet consumed
        self.index: int | None = None
        self.key: str | None = None
        self.num_pairs = 0

    @property
    def is_inside(self) -> bool:
        return True

    def feed_char(self, char: str, events: list[Event]) -> bool:
        """Take one character of the call's inside; always part of the call."""
        self.text += char
        if self.index is None:  # the name runs to a newline or the first <arg_key>
            at = self.text.find(self._KEY[0])
            if at >= 0:
                self._start(self.text[:at].strip(), events)
                self.text = self.text[at:]
            elif char == "\n" and self.text.strip():
                self._start(self.text.strip(), events)
                self.text = ""
            return True
        body = self.text.lstrip()
        opening, closing = self._KEY if self.key is None else self._VALUE
        if (body.startswith(opening) and body.endswith(closing)
                and len(body) >= len(opening) + len(closing)):
            inner = body[len(opening):-len(closing)]
            if self.key is None:
                self.key = inner.strip()
            else:
                lead = "{" if self.num_pairs == 0 else ", "
                pair = f"{json.dumps(self.key, ensure_ascii=False)}: {_json_value(inner)}"
                events.append(CallArguments(self.index, lead + pair))
                self.key = None
                self.num_pairs += 1
            self.text = ""
        return True

    def _start(self, name: str, events: list[Event]) -> None:
        self.index = self._parser.next_index()
        events.append(CallStart(self.index, name))

    def finish(self, events: list[Event]) -> None:
        """The call ended (its end tag, or the output's end): close the arguments."""
        if self.index is None and self.text.strip():
            self._start(self.text.strip(), events)
        if self.index is not None:
            events.append(CallArguments(self.index, "}" if self.num_pairs else "{}"))
        self._reset()


def _json_value(text: str) -> str:
    """An argument value as JSON text: itself where it parses as JSON, else a JSON string."""
    try:
        return json.dumps(json.loads(text), ensure_ascii=False)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)


class _NamedArguments:
    """Mistral's v11 form, `[TOOL_CALLS]name[ARGS]{...}` (v13: `name[CALL_ID]id[ARGS]{...}`):
    a name, then one JSON value streamed until it closes."""

    def __init__(self, parser: ToolCallParser):
        self._parser = parser
        self.text = ""  # everything taken, given back as text if it is no call after all
        self.name: str | None = None
        self.index = -1
        self.depth = 0
        self.in_string = self.escape = False

    def feed_char(self, char: str, events: list[Event]) -> str:
        """'more', 'done' (the call ended) or 'text' (not a call: self.text is plain text)."""
        self.text += char
        if self.name is None:
            if self.text.endswith("[ARGS]"):
                # v13 templates (Mistral Small 3.2, Devstral) put `[CALL_ID]id` before [ARGS].
                head = self.text[:-len("[ARGS]")].split("[CALL_ID]", 1)[0]
                self.name = head.rsplit("]", 1)[-1]
                self.index = self._parser.next_index()
                events.append(CallStart(self.index, self.name))
                return "more"
            is_name = char.isalnum() or char in "_.:-[]"
            return "more" if is_name and len(self.text) <= 160 else "text"
        events.append(CallArguments(self.index, char))
        if self.in_string:
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
            return "more"
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
        return "done" if self.depth == 0 and char not in " \t\r\n" else "more"


class ToolCallParser:
    """Feed text pieces, get TextPiece / CallStart / CallArguments events in order."""

    def __init__(self, format_name: str):
        self.format = FORMATS[format_name]
        self._pending = ""
        self._in_calls = False
        self._seen_text = False  # a non-blank character went out as text
        self._objects: _CallObjects | _XmlCall = (
            _XmlCall(self) if format_name == "glm" else _CallObjects(self))
        self._named: _NamedArguments | None = None
        self.num_calls = 0
        # The call block being read: its text and its events, held until its first call
        # starts; a block that ends without one is given back as text whole (None: a call
        # started, the block streams).
        self._block: list[str] = []
        self._held: list[Event] | None = None
        self._calls_before_block = 0

    def next_index(self) -> int:
        self.num_calls += 1
        return self.num_calls - 1

    def feed(self, text: str) -> list[Event]:
        """Events for one more piece of the output."""
        events: list[Event] = []
        self._pending += text
        self._run(events, is_final=False)
        return merged_pieces(events)

    def finish(self) -> list[Event]:
        """Events for whatever was held back when the output ends."""
        events: list[Event] = []
        self._run(events, is_final=True)
        if self._in_calls:
            sink = self._sink(events)
            if self._named is not None and self._named.name is None:
                sink.append(TextPiece(self._named.text))
            else:
                self._objects.finish(sink)
            self._named = None
            self._close_block("", events)
        elif self._pending:
            events.append(TextPiece(self._pending))
        self._pending = ""
        return merged_pieces(events)

    def _open_block(self, opening: str) -> None:
        self._in_calls = True
        self._block, self._held = [opening], []
        self._calls_before_block = self.num_calls

    def _sink(self, events: list[Event]) -> list[Event]:
        return events if self._held is None else self._held

    def _take(self, char: str, events: list[Event]) -> None:
        """char belongs to the block: keep its text until a call started, then stream."""
        if self._held is None:
            return
        self._block.append(char)
        if self.num_calls > self._calls_before_block:
            events.extend(self._held)
            self._held = None

    def _close_block(self, closing: str, events: list[Event]) -> None:
        if self._held is not None:
            if self.num_calls > self._calls_before_block:
                events.extend(self._held)
            else:  # no call in it (not JSON, no name): the model's text, as it wrote it
                self._emit_text("".join(self._block) + closing, events)
        self._held, self._block, self._in_calls = None, [], False

    def _run(self, events: list[Event], is_final: bool) -> None:
        while self._pending:
            progressed = self._calls(events, is_final) if self._in_calls \
                else self._text(events, is_final)
            if not progressed:
                return

    def _text(self, events: list[Event], is_final: bool) -> bool:
        fmt, pending = self.format, self._pending
        if fmt.json_at_start and not self._seen_text:
            stripped = pending.lstrip()
            if not stripped:
                return False
            is_marker = bool(fmt.start) and (stripped.startswith(fmt.start) or (
                fmt.start.startswith(stripped) and not is_final))
            if is_marker and not stripped.startswith(fmt.start):
                return False  # maybe the marker: wait for more
            if stripped[0] in "{[" and not is_marker:
                self._open_block(pending[:len(pending) - len(stripped)])
                self._pending = stripped
                return True
        start = fmt.start
        at = pending.find(start) if start else -1
        if at >= 0:
            self._emit_text(pending[:at], events)
            self._open_block(start)
            self._pending = pending[at + len(start):]
            return True
        keep = 0 if is_final or not start else _partial_suffix(pending, start)
        if not fmt.json_at_start or self._seen_text or pending.strip():
            self._emit_text(pending[:len(pending) - keep], events)
            self._pending = pending[len(pending) - keep:]
        return False

    def _emit_text(self, text: str, events: list[Event]) -> None:
        if text:
            events.append(TextPiece(text))
            self._seen_text = self._seen_text or bool(text.strip())

    def _back_to_text(self, rest: str, given_back: str, events: list[Event]) -> bool:
        """Something that is no call follows: the block ends, rest is text again (after
        given_back, the block's own text that a started call does not hold)."""
        self._objects.between = ""
        if self._held is not None:
            self._close_block("", events)
            self._pending = rest
        else:
            self._in_calls, self._block = False, []
            self._pending = given_back + rest
        self._seen_text = True
        return True

    def _calls(self, events: list[Event], is_final: bool) -> bool:
        end, pending = self.format.end, self._pending
        limit = len(pending)
        if end:
            at = pending.find(end)
            if at >= 0:
                limit = at
            elif not is_final:
                limit = len(pending) - _partial_suffix(pending, end)
        for i in range(limit):
            char = pending[i]
            sink = self._sink(events)
            if self._named is not None or (self.format.name == "mistral" and char.isalpha()
                                           and not self._objects.is_inside):
                self._named = self._named or _NamedArguments(self)
                state = self._named.feed_char(char, sink)
                self._take(char, events)
                if state == "done":
                    self._named = None
                elif state == "text":
                    named, self._named = self._named, None
                    return self._back_to_text(pending[i + 1:], named.text, events)
                continue
            if not self._objects.feed_char(char, sink):
                between = self._objects.between  # what closed the list of calls is no text
                return self._back_to_text(pending[i:], between[between.rfind("]") + 1:],
                                          events)
            self._take(char, events)
        if end and limit < len(pending) and pending.startswith(end, limit):
            self._objects.finish(self._sink(events))
            self._close_block(end, events)
            self._pending = pending[limit + len(end):]
            return True
        self._pending = pending[limit:]
        return False


def merged_pieces(events: list[Any]) -> list[Any]:
    """Adjacent pieces of one kind (reasoning, text, or argument pieces of one call) joined;
    the Harmony parser's events too."""
    out: list[Any] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Reasoning) and isinstance(last, Reasoning):
            out[-1] = Reasoning(last.text + event.text)
        elif isinstance(event, TextPiece) and isinstance(last, TextPiece):
            out[-1] = TextPiece(last.text + event.text)
        elif (isinstance(event, CallArguments) and isinstance(last, CallArguments)
              and last.index == event.index):
            out[-1] = CallArguments(last.index, last.text + event.text)
        else:
            out.append(event)
    return out


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that could be the start of marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


@dataclass
class ParsedCall:
    name: str
    arguments: str


def parse_all(format_name: str, text: str) -> tuple[str, list[ParsedCall]]:
    """The whole output at once: its text (calls removed) and its calls."""
    parser = ToolCallParser(format_name)
    events = parser.feed(text) + parser.finish()
    texts: list[str] = []
    calls: list[ParsedCall] = []
    for event in events:
        if isinstance(event, TextPiece):
            texts.append(event.text)
        elif isinstance(event, CallStart):
            calls.append(ParsedCall(event.name, ""))
        else:
            calls[event.index].arguments += event.text
    return "".join(texts), calls
