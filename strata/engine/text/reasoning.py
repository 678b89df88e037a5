"""Reasoning split out of a thinking model's output: `<think>...</think>` (Qwen3,
DeepSeek-R1, GLM-4.5) or `[THINK]...[/THINK]` (Magistral, Ministral 3 Reasoning).

The model's text before the closing tag is its reasoning (OpenAI's `reasoning_content`,
Anthropic's thinking blocks); what follows is the answer. A template that opens the think block
itself (DeepSeek-R1's generation prompt ends in `<think>\\n`) starts the output inside it.
Mistral's tags are special tokens: the detokenizer shows them (text/assets.py) so they reach
this splitter.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ThinkTags:
    """The text that opens and closes a think block."""
    start: str
    end: str


THINK = ThinkTags("<think>", "</think>")
MISTRAL_THINK = ThinkTags("[THINK]", "[/THINK]")  # special tokens of the Tekken vocabulary


def think_tags(template_source: str | None) -> ThinkTags | None:
    """The think block a chat template's model writes, or None for a model that does not
    think. Read from the template, not the vocabulary: Mistral's instruct models carry the
    [THINK] tokens too but never write them."""
    source = template_source or ""
    if THINK.end in source:
        return THINK
    if MISTRAL_THINK.end in source:  # the Reasoning template's thinking content parts
        return MISTRAL_THINK
    return None


def template_thinks(template_source: str | None) -> bool:
    """Whether a chat template belongs to a model that writes think blocks."""
    return think_tags(template_source) is not None


def template_uses(template_source: str | None, variable: str) -> bool:
    """Whether a chat template reads a variable (enable_thinking, ...), so setting it acts."""
    return variable in (template_source or "")


def prompt_opens_thinking(prompt_text: str, tags: ThinkTags = THINK) -> bool:
    """The rendered prompt ends inside an open think block."""
    tail = prompt_text.rstrip()
    return tail.endswith(tags.start)


@dataclass(frozen=True)
class Reasoning:
    text: str


@dataclass(frozen=True)
class Answer:
    text: str


class ReasoningSplitter:
    """Feed text pieces; get Reasoning and Answer pieces in order."""

    def __init__(self, *, starts_inside: bool = False, tags: ThinkTags = THINK):
        self._tags = tags
        self._state = "inside" if starts_inside else "start"  # start | inside | answer
        self._pending = ""
        self._strip_answer_start = False
        self._strip_reasoning_start = True  # the newline templates put after the opening tag

    def feed(self, text: str) -> list[Reasoning | Answer]:
        self._pending += text
        return self._run(is_final=False)

    def finish(self) -> list[Reasoning | Answer]:
        return self._run(is_final=True)

    def _run(self, is_final: bool) -> list[Reasoning | Answer]:
        out: list[Reasoning | Answer] = []
        start, end = self._tags.start, self._tags.end
        if self._state == "start":
            stripped = self._pending.lstrip()
            if stripped.startswith(start):
                self._pending, self._state = stripped[len(start):], "inside"
            elif not is_final and start.startswith(stripped):
                return out  # maybe the opening tag: wait
            else:
                # No think block (GLM with thinking off: the prompt closed an empty one): the
                # newlines its template puts before an answer are not the answer's.
                self._state, self._strip_answer_start = "answer", True
        if self._state == "inside":
            if self._strip_reasoning_start:
                self._pending = self._pending.lstrip("\n")
                if not self._pending and not is_final:
                    return out
                self._strip_reasoning_start = False
            at = self._pending.find(end)
            if at >= 0:
                reasoning = self._pending[:at].rstrip("\n")
                if reasoning:
                    out.append(Reasoning(reasoning))
                self._pending, self._state = self._pending[at + len(end):], "answer"
                self._strip_answer_start = True
            else:
                keep = 0 if is_final else _held(self._pending, end)
                piece = self._pending[:len(self._pending) - keep]
                if piece:
                    out.append(Reasoning(piece))
                self._pending = self._pending[len(self._pending) - keep:]
                return out
        if self._state == "answer":
            if self._strip_answer_start:  # the blank lines a template puts after the block
                self._pending = self._pending.lstrip("\n")
                if not self._pending and not is_final:
                    return out
                self._strip_answer_start = False
            if self._pending:
                out.append(Answer(self._pending))
            self._pending = ""
        return out


def _held(text: str, end: str) -> int:
    """Characters at the end that could begin the closing tag or be newlines before it."""
    for size in range(min(len(end) - 1, len(text)), 0, -1):
        if end.startswith(text[-size:]):
            return size + (len(text[:-size]) - len(text[:-size].rstrip("\n")))
    return len(text) - len(text.rstrip("\n"))
