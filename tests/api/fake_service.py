"""An in-process ServiceFacade for API tests: deterministic token ids, recorded calls."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from strata.engine.protocol import Done, Embeddings, Error, TokenLogprob, Tokens, Usage
from strata.engine.service.facade import GenerationRequest, ServiceError
from strata.engine.text.sampling_defaults import SamplingDefaults
from tests.fakes.status import counters, service_status

CACHED_TOKENS = 3
EMBEDDING_SIZE = 8


class FakeService:
    """Answers every generation with `reply_text` tokenized by the real tokenizer, then EOS.

    Knobs: fail_after (emit an Error event after N tokens), start_error (raise before the
    first event), first_error (an Error event as the first event), is_endless (emit tokens
    until closed), token_delay_s. Every call is recorded in `calls`; `num_closed_early` counts
    generations that the API closed before they finished.
    """

    def __init__(self, text: Any, *, reply_text: str = "Hello world! The answer is 42.",
                 context_tokens: int = 512, model_id: str = "tiny-test-model"):
        self.text = text
        self.model_id = model_id
        self.context_tokens = context_tokens
        self.num_slots = 4
        self.sampling_defaults = SamplingDefaults()  # a model without its own: llama.cpp's
        self.reply_text = reply_text
        self.state = "loaded"
        self.calls: list[tuple[Any, ...]] = []
        self.requests: list[GenerationRequest] = []
        self.fail_after: int | None = None
        self.start_error: ServiceError | None = None
        self.first_error: Error | None = None
        self.control_error: BaseException | None = None
        self.is_endless = False
        self.token_delay_s = 0.0
        self.num_closed_early = 0
        self.done_slots: list[int] = []  # Done.slot of each generation, in order
        self.closed_early = asyncio.Event()
        self.counters = counters(tokens_per_second=12.5)

    def reply_ids(self) -> list[int]:
        return [*self.text.encode(self.reply_text, add_special=False), self.text.eos_token_ids[0]]

    def generate(self, request: GenerationRequest):
        """The service's iterator (as Service.generate, an async generator, hands out)."""
        self.calls.append(("generate", request))
        self.requests.append(request)
        return FakeStream(self, self._events(request), request)

    async def _events(self, request: GenerationRequest):
        if self.start_error is not None:
            raise self.start_error
        if self.first_error is not None:
            yield self.first_error
            return
        rid = f"req-{len(self.requests)}"
        ids = self.reply_ids()
        num_emitted = 0
        while self.is_endless or num_emitted < len(ids):
            if self.fail_after is not None and num_emitted == self.fail_after:
                yield Error("internal", "the engine fell over", request_id=rid)
                return
            if num_emitted == request.sampling.max_tokens:
                break
            token = ids[0] if self.is_endless else ids[num_emitted]
            num_emitted += 1
            yield Tokens(rid, (token,), self._logprobs(token, request.sampling.num_logprobs))
            await asyncio.sleep(self.token_delay_s)
            if token in request.sampling.stop_token_ids:
                break
        reason = "length" if num_emitted == request.sampling.max_tokens else "stop"
        self.counters["requests_total"] += 1
        self.counters["completion_tokens_total"] += num_emitted
        # As the engine: a request without a slot gets one (here the next in turn: LRU).
        slot = request.slot if request.slot is not None else (
            (len(self.requests) - 1) % self.num_slots)
        self.done_slots.append(slot)
        yield Done(rid, Usage(len(request.prompt_ids), num_emitted, CACHED_TOKENS, reason), slot)

    def _logprobs(self, token: int, num_top: int | None) -> tuple[TokenLogprob, ...]:
        # As the real engine: one record per token when asked, with num_top alternatives.
        if num_top is None:
            return ()
        top = tuple(((token + j) % self.text.vocab_size, -0.25 - j) for j in range(num_top))
        return (TokenLogprob(token, -0.25, top),)

    async def embed(self, token_ids, pooling: str) -> Embeddings:
        """As the engine answers Embed: one unit vector of EMBEDDING_SIZE floats per sequence,
        here a function of the ids, so equal inputs give equal vectors."""
        self.calls.append(("embed", [list(ids) for ids in token_ids], pooling))
        if self.start_error is not None:
            raise self.start_error
        vectors = []
        for ids in token_ids:
            raw = [float((sum(ids) * (j + 1) + len(ids)) % 7 - 3) or 1.0
                   for j in range(EMBEDDING_SIZE)]
            length = math.sqrt(sum(x * x for x in raw))
            vectors.append(tuple(x / length for x in raw))
        return Embeddings("embed-fake", tuple(vectors), sum(len(ids) for ids in token_ids))

    async def control(self, action: str, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(("control", action, kwargs))
        if self.control_error is not None:
            raise self.control_error
        if action.startswith("slot_"):  # the engine's llama.cpp payload, as Service nests it
            return {"action": action, "result": _slot_payload(action, **kwargs), **self.status()}
        return {"action": action, "ok": True, **kwargs}

    def set_unload_idle(self, seconds: float | None) -> None:
        self.calls.append(("set_unload_idle", seconds))

    async def forward_counts(self) -> Any:
        return None  # no engine runs behind this fake

    def status(self) -> dict[str, Any]:
        return service_status(model=self.model_id, state=self.state,
                              model_path="/models/tiny", context_tokens=self.context_tokens,
                              counters=dict(self.counters))


def _slot_payload(action: str, slot: int, filename: str = "") -> dict[str, Any]:
    """What core/slots.py answers for a slot of 3 tokens and 96 bytes."""
    if action == "slot_erase":
        return {"id_slot": slot, "n_erased": 3}
    verb = action.removeprefix("slot_")
    counts = {"save": ("n_saved", "n_written"), "restore": ("n_restored", "n_read")}[verb]
    return {"id_slot": slot, "filename": filename, counts[0]: 3, counts[1]: 96,
            "timings": {f"{verb}_ms": 1.5}}


class FakeStream:
    """The iterator generate() hands out. An explicit aclose() before the end counts as a cancel,
    and so does a CancelledError thrown in while it waits (a handler cancelled on disconnect);
    unlike an async generator, nothing closes it when it is garbage collected.
    """

    def __init__(self, service: FakeService, events, request: GenerationRequest | None = None):
        self._service = service
        self._events = events
        self._request = request
        self._num_tokens = 0
        self._is_finished = False
        self._is_closed = False

    def _report_final(self, final: Done | Error | None) -> None:
        """As Service does: the final event to request.on_final, also after an early close
        (then a cancelled Done with the usage so far, as the engine answers a Cancel)."""
        if self._request is not None and self._request.on_final is not None:
            self._request.on_final(final)

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self):
        try:
            event = await anext(self._events)
        except asyncio.CancelledError:  # the handler was cancelled while waiting: a cancel too
            self._record_cancel()
            raise
        except BaseException:
            self._is_finished = True
            raise
        if isinstance(event, Tokens):
            self._num_tokens += len(event.token_ids)
        if isinstance(event, (Done, Error)):
            self._is_finished = True
            self._report_final(event)
        return event

    def _record_cancel(self) -> None:
        if not self._is_finished and not self._is_closed:
            self._service.num_closed_early += 1
            self._service.closed_early.set()
            if self._request is not None:
                usage = Usage(len(self._request.prompt_ids), self._num_tokens, CACHED_TOKENS,
                              "cancelled")
                self._report_final(Done("req-cancelled", usage))
        self._is_finished = True

    async def aclose(self) -> None:
        self._record_cancel()
        self._is_closed = True
        await self._events.aclose()
