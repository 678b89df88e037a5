"""From a validated request to text: start the service's generation, detokenize, stop strings.

The routes of every API dialect go through here, so stop handling and cancellation behave the
same on /v1/chat/completions, /v1/completions and /v1/messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import Any, Protocol

from aiohttp import web

from strata.engine.api.cpu_pool import run_cpu
from strata.engine.api.errors import CONTEXT_EXCEEDED, ApiError, bad_request, from_error_event
from strata.engine.api.params import GenerationParams
from strata.engine.api.validation import check_slot
from strata.engine.protocol import (
    Done,
    Error,
    PromptProgress,
    SamplingSpec,
    TokenLogprob,
    Tokens,
    Usage,
)
from strata.engine.service.facade import GenerationRequest, ServiceError, ServiceFacade
from strata.engine.text import ChatTemplateError, IncrementalDetokenizer, StopMatcher
from strata.engine.text.assets import TextAssets
from strata.engine.text.token_bytes import token_text

Event = Tokens | Done | Error | PromptProgress
Events = AsyncGenerator[Event, None]  # what ServiceFacade.generate hands out


class TextDeltas(Protocol):
    """What the answer writers read from a generation: a TextGeneration, or a
    BudgetedGeneration (thinking_budget.py) that chains two of them."""

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def stop_sequence(self) -> str | None: ...

    @property
    def usage(self) -> Usage | None: ...

    @property
    def slot(self) -> int | None: ...

    def deltas(self) -> AsyncGenerator[str, None]: ...

    def take_logprobs(self) -> list[TokenLogprob]: ...

    async def close(self) -> None: ...


def ended_usage(generation: TextDeltas) -> Usage:
    """The usage of a generation whose deltas() ran to the end (it is set when it ends)."""
    if generation.usage is None:
        raise ApiError(500, "the generation ended without a usage count", "internal")
    return generation.usage


def text_assets(service: ServiceFacade) -> TextAssets:
    """The model's TextAssets, or a 503 when the service has none to give (not started)."""
    try:
        return service.text
    except ServiceError as exc:
        raise ApiError(503, f"the model's tokenizer is not available: {exc}",
                       "tokenizer_unavailable") from None


def check_fits_context(num_prompt_tokens: int, max_tokens: int | None,
                       context_tokens: int, server_max_tokens: int | None = None) -> int:
    """The max_tokens to use: the request's (capped at the server's --max-tokens), else the
    server's or what is left of the context, whichever is less. 400 if too long."""
    if max_tokens is not None and server_max_tokens is not None:
        max_tokens = min(max_tokens, server_max_tokens)
    if context_tokens <= 0:  # the service does not know its context yet; the engine checks
        return max_tokens if max_tokens is not None else server_max_tokens or 256
    if max_tokens is None:
        if num_prompt_tokens >= context_tokens:
            raise _past_context(f"prompt is {num_prompt_tokens} tokens, the context is "
                                f"{context_tokens} tokens; shorten the prompt",
                                num_prompt_tokens, context_tokens)
        return min(context_tokens - num_prompt_tokens, server_max_tokens or context_tokens)
    if num_prompt_tokens + max_tokens > context_tokens:
        raise _past_context(f"prompt is {num_prompt_tokens} tokens, the context is "
                            f"{context_tokens} tokens and max_tokens {max_tokens} does not fit "
                            "after it; shorten the prompt or lower max_tokens",
                            num_prompt_tokens, context_tokens)
    return max_tokens


def _past_context(message: str, num_prompt_tokens: int, context_tokens: int) -> ApiError:
    """The 400 for a prompt past the context, with llama-server's n_prompt_tokens and n_ctx."""
    return ApiError(400, message, CONTEXT_EXCEEDED, param="messages",
                    fields={"n_prompt_tokens": num_prompt_tokens, "n_ctx": context_tokens})


class TextGeneration:
    """One running generation as text deltas; usage and finish reason once it has ended.

    Create with `await TextGeneration.start(...)`: that waits for the first event, so a failure
    to start (ServiceError, an Error event) surfaces before any response header is sent.
    """

    def __init__(self, events: Events, first_event: Event, assets: TextAssets,
                 stops: Sequence[str], num_prompt_tokens: int,
                 finals: list[Done | Error | None] | None = None,
                 sampling: SamplingSpec | None = None):
        self._events = events
        self.sampling = sampling  # what the engine was asked for, defaults filled
        self._finals = finals if finals is not None else []  # the engine's final event
        self._pending: Event | None = first_event
        self._detokenizer = IncrementalDetokenizer(assets, skip_special=True)
        self._matcher = StopMatcher(list(stops))
        self._num_prompt_tokens = num_prompt_tokens
        self._num_completion_tokens = 0
        self.token_ids: list[int] = []  # every token read, so a continuation can extend them
        self._raw_text = ""  # everything pushed to the matcher, to name the stop that hit
        self._emitted_chars = 0
        self._is_closed = False
        self.finish_reason: str | None = None  # stop | length
        self.stop_sequence: str | None = None
        self._is_stop_string_hit = False
        self.usage: Usage | None = None
        # Logprob records of the tokens read so far that produce text (stop tokens left out).
        self._logprobs: list[TokenLogprob] = []
        self._num_logprobs_taken = 0
        self._silent_ids = frozenset(assets.eos_token_ids)
        self._assets = assets

    @classmethod
    async def start(cls, service: ServiceFacade, assets: TextAssets, prompt_ids: Sequence[int],
                    sampling: SamplingSpec, stops: Sequence[str],
                    slot: int | None) -> TextGeneration:
        """Queue the generation and wait for its first event."""
        finals: list[Done | Error | None] = []
        request = GenerationRequest(prompt_ids=tuple(prompt_ids), sampling=sampling, slot=slot,
                                    on_final=finals.append)
        events = service.generate(request)
        try:
            first = await anext(events)
        except StopAsyncIteration:
            raise ApiError(500, "the engine ended the generation without a result; retry",
                           "internal") from None
        except BaseException:
            await events.aclose()
            raise
        if isinstance(first, Error):
            await events.aclose()
            raise from_error_event(first)
        return cls(events, first, assets, stops, len(prompt_ids), finals, sampling)

    async def deltas(self) -> AsyncGenerator[str, None]:
        """Non-empty text pieces in order; raises ApiError if the engine fails mid-way."""
        async with aclosing(self.pieces()) as pieces:
            async for piece in pieces:
                if isinstance(piece, str):
                    yield piece

    async def pieces(self) -> AsyncGenerator[str | PromptProgress, None]:
        """deltas(), with the engine's PromptProgress reports before the text where the
        request asked for them (SamplingSpec.return_progress)."""
        try:
            while self.finish_reason is None:
                event = self._pending if self._pending is not None else await self._next()
                self._pending = None
                if isinstance(event, PromptProgress):
                    yield event
                    continue
                if isinstance(event, Tokens):
                    self._num_completion_tokens += len(event.token_ids)
                    self.token_ids += event.token_ids
                    self._logprobs += [r for r in event.logprobs
                                       if r.token_id not in self._silent_ids]
                    text = self._push(self._detokenizer.push(list(event.token_ids)))
                elif isinstance(event, Done):
                    text = self._finish(event.usage)
                else:
                    raise from_error_event(event)
                if text:
                    yield text
        finally:
            await self.close()

    async def _next(self) -> Event:
        try:
            return await anext(self._events)
        except StopAsyncIteration:
            raise ApiError(500, "the engine stream ended without a final result; retry",
                           "internal") from None

    def _push(self, text: str, *, is_last: bool = False) -> str:
        self._raw_text += text
        emit, hit = self._matcher.push(text)
        if not hit and is_last:
            emit += self._matcher.flush()
        self._emitted_chars += len(emit)
        if hit:
            self._on_stop_hit()
        return emit

    def _on_stop_hit(self) -> None:
        self.stop_sequence = self._matcher.matched
        self.finish_reason = "stop"
        self._is_stop_string_hit = True
        self._trim_logprobs()
        # Completion tokens up to the hit; the cached count comes with the engine's Done,
        # which arrives once close() has cancelled the rest (see _take_engine_usage).
        self.usage = Usage(self._num_prompt_tokens, self._num_completion_tokens, 0, "stop")

    def _take_engine_usage(self, usage: Usage) -> None:
        """A stop string ended the text: the engine's prompt and cached counts, ours for the
        completion (tokens past the stop string were never shown)."""
        self.usage = dataclasses.replace(usage, completion_tokens=self._num_completion_tokens,
                                         finish_reason="stop")

    def _finish(self, usage: Usage) -> str:
        text = self._push(self._detokenizer.flush(), is_last=True)
        if self.finish_reason == "stop":  # a stop string hit in the last piece
            self._take_engine_usage(usage)
            return text
        if usage.finish_reason == "cancelled":
            raise ApiError(503, "the generation was cancelled by the server (the model was "
                           "unloaded or put to sleep); retry the request", "cancelled")
        self.finish_reason = "length" if usage.finish_reason == "length" else "stop"
        self.usage = usage
        return text

    def _trim_logprobs(self) -> None:
        """After a stop string: keep the records of tokens whose text was (at least partly)
        sent, not those of the stop string and what came after it."""
        kept, num_chars = [], 0
        for record in self._logprobs:
            if num_chars >= self._emitted_chars:
                break
            kept.append(record)
            num_chars += len(token_text(self._assets, record.token_id))
        self._logprobs = kept
        self._num_logprobs_taken = min(self._num_logprobs_taken, len(kept))

    @property
    def slot(self) -> int | None:
        """The cache slot the engine ran this in (Done.slot), once it has ended."""
        final = self._finals[-1] if self._finals else None
        return final.slot if isinstance(final, Done) else None

    def take_logprobs(self) -> list[TokenLogprob]:
        """Logprob records of the tokens read since the last call (when the request asked)."""
        records = self._logprobs[self._num_logprobs_taken:]
        self._num_logprobs_taken = len(self._logprobs)
        return records

    async def close(self) -> None:
        """Close the service's iterator, which cancels the generation in the engine."""
        if not self._is_closed:
            self._is_closed = True
            await self._events.aclose()
            final = self._finals[-1] if self._finals else None
            if self._is_stop_string_hit and isinstance(final, Done):
                self._take_engine_usage(final.usage)

    async def collect(self) -> str:
        """All the text at once, for non-streaming responses."""
        return "".join([piece async for piece in self.deltas()])


async def render_chat_prompt(app: web.Application, assets: TextAssets,
                             messages: list[dict[str, Any]], prefill: str = "", **extra: Any
                             ) -> tuple[str, list[int]]:
    """(text, token ids) of the model's chat template applied to messages, off the event
    loop, rendered once; template failures are the client's 400. prefill: assistant text
    written after the generation prompt, for the model to continue. extra (tools,
    enable_thinking, ...) reaches the template."""
    def render_and_encode() -> tuple[str, list[int]]:
        text = assets.apply_chat_template(messages, **extra) + prefill
        return text, assets.encode_rendered(text)

    try:
        return await run_cpu(app, render_and_encode)
    except ChatTemplateError as exc:
        raise bad_request(f"the model's chat template refused the messages: {exc}",
                          param="messages") from None


async def prompt_token_ids(app: web.Application, assets: TextAssets, prompt: Any) -> list[int]:
    """A prompt string, a list of token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty; send some text", param="prompt")
        return list(await run_cpu(app, assets.encode, prompt, add_special=True))
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        if not all(0 <= t < assets.vocab_size for t in prompt):
            raise bad_request(f"'prompt' has token ids outside 0..{assets.vocab_size - 1}",
                              param="prompt")
        return prompt
    raise bad_request("'prompt' must be a non-empty string or list of token ids; batches of "
                      "prompts are not supported", param="prompt")


async def start_text_generation(service: ServiceFacade, assets: TextAssets,
                                prompt_ids: Sequence[int], params: GenerationParams,
                                grammar: str | None = None,
                                choice: int = 0) -> TextGeneration:
    """Check the prompt fits, then start a generation with the request's GenerationParams,
    its sampling fields left out filled from the service's defaults; grammar (api/grammar.py)
    constrains the output. choice: which of the request's n choices (its seed is offset)."""
    if params.slot is not None:  # the configured slots (--slots), known only here
        check_slot(params.slot, params.slot_param, service.num_slots)
    defaults = service.sampling_defaults
    max_tokens = check_fits_context(len(prompt_ids), params.max_tokens, service.context_tokens,
                                    defaults.max_tokens)
    sampling = params.sampling(max_tokens, tuple(assets.eos_token_ids), defaults,
                               assets.vocab_size, choice)
    if grammar is not None:
        sampling = dataclasses.replace(sampling, grammar=grammar)
    return await TextGeneration.start(service, assets, prompt_ids, sampling, params.stops,
                                      params.slot)
