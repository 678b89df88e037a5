"""Anthropic's thinking.budget_tokens, enforced: reasoning stops after that many tokens.

The generation runs with max_tokens = budget first. If it is cut there while still inside the
think block, Strata closes the block itself (appends `</think>` to the tokens so far, in the
same cache slot, so nothing is prefilled again) and the model answers with what is left of
max_tokens. Cut there after the block closed, it simply continues. Anthropic calls the budget
a target; here it is a limit, the way llama.cpp's reasoning budget ends thinking. A Harmony
model (gpt-oss) has its analysis message ended and a final one opened instead (HARMONY).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

from strata.engine.api.textgen import TextGeneration
from strata.engine.protocol import TokenLogprob, Usage
from strata.engine.text.harmony import CLOSE_ANALYSIS, analysis_is_open
from strata.engine.text.reasoning import MISTRAL_THINK, THINK, ThinkTags

CLOSE_TEXT = f"\n{THINK.end}\n\n"  # what Qwen3 and DeepSeek-R1 write between thought and answer


@dataclass(frozen=True)
class ThinkingFormat:
    """How to tell the reasoning is still open, and the text that closes it."""
    close_text: str
    is_open: Callable[[str], bool]


THINK_BLOCK = ThinkingFormat(CLOSE_TEXT, lambda text: THINK.end not in text)
# Magistral / Ministral 3 Reasoning write the answer right after [/THINK] (their template's
# system prompt shows the block that way).
MISTRAL_THINK_BLOCK = ThinkingFormat(MISTRAL_THINK.end,
                                     lambda text: MISTRAL_THINK.end not in text)
HARMONY = ThinkingFormat(CLOSE_ANALYSIS, analysis_is_open)


def thinking_format(tags: ThinkTags) -> ThinkingFormat:
    """How a model with these think tags has its reasoning closed at the budget."""
    return THINK_BLOCK if tags == THINK else MISTRAL_THINK_BLOCK

StartPart = Callable[[list[int], int], Awaitable[TextGeneration]]  # (prompt ids, max tokens)


class BudgetedGeneration:
    """A TextGeneration's interface over up to two generations: the thinking within the
    budget, then (when it was cut) the rest. Start with `await BudgetedGeneration.start(...)`."""

    def __init__(self, first: TextGeneration, start_part: StartPart, prompt_ids: list[int],
                 budget_tokens: int, max_tokens: int, close_ids: list[int],
                 thinking: ThinkingFormat = THINK_BLOCK):
        self._current = first
        self._first = first
        self._start_part = start_part
        self._prompt_ids = prompt_ids
        self._budget_tokens = budget_tokens
        self._max_tokens = max_tokens
        self._close_ids = close_ids
        self._thinking = thinking
        self._text = ""
        self.usage: Usage | None = None
        self.is_budget_hit = False

    @classmethod
    async def start(cls, start_part: StartPart, prompt_ids: list[int], budget_tokens: int,
                    max_tokens: int, close_ids: list[int],
                    thinking: ThinkingFormat = THINK_BLOCK) -> BudgetedGeneration:
        first = await start_part(prompt_ids, min(budget_tokens, max_tokens))
        return cls(first, start_part, prompt_ids, budget_tokens, max_tokens, close_ids,
                   thinking)

    @property
    def finish_reason(self) -> str | None:
        return self._current.finish_reason

    @property
    def stop_sequence(self) -> str | None:
        return self._current.stop_sequence

    @property
    def slot(self) -> int | None:
        """The cache slot of the last part (both run in one: the second extends the first)."""
        return self._current.slot

    def take_logprobs(self) -> list[TokenLogprob]:
        return self._current.take_logprobs()

    async def deltas(self) -> AsyncGenerator[str, None]:
        async for text in self._first.deltas():
            self._text += text
            yield text
        self.usage = self._first.usage
        left = self._max_tokens - self._budget_tokens
        if self._first.finish_reason != "length" or left <= 0:
            return
        # Cut by the budget: close the think block if it is still open, then go on.
        extra = self._close_ids if self._thinking.is_open(self._text) else []
        self.is_budget_hit = bool(extra)
        if extra:
            yield self._thinking.close_text
        prompt = [*self._prompt_ids, *self._first.token_ids, *extra]
        self._current = await self._start_part(prompt, left - len(extra))
        async for text in self._current.deltas():
            yield text
        self.usage = _sum(self._first.usage, self._current.usage)

    async def close(self) -> None:
        await self._first.close()
        await self._current.close()


def _sum(first: Usage | None, second: Usage | None) -> Usage | None:
    """One request's usage over both parts: the first part's prompt, both parts' output."""
    if first is None or second is None:
        return second or first
    return dataclasses.replace(second, prompt_tokens=first.prompt_tokens,
                               cached_tokens=first.cached_tokens,
                               completion_tokens=first.completion_tokens
                               + second.completion_tokens)
