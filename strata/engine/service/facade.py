"""What the HTTP API and the tray need from the service: one small async interface.

`Service` (engine/service/service.py) implements it over the real engine process; API tests
use a fake engine behind the same Supervisor, so the routes never know which one runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from strata.engine.protocol import Done, Embeddings, Error, PromptProgress, SamplingSpec, Tokens
from strata.engine.service.error_codes import ServiceError as ServiceError  # re-exported

if TYPE_CHECKING:  # the tokenizer library stays out of the facade's import
    from strata.engine.text.assets import TextAssets


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    sampling: SamplingSpec
    slot: int | None = None  # None: the engine picks (longest cached prefix, else LRU)
    # Called with the engine's final event once the generation is over, also when the caller
    # closed the iterator early (a stop string): that Done carries the real usage.
    on_final: Callable[[Done | Error | None], None] | None = field(default=None, compare=False)


def with_load_time(request: GenerationRequest, load_s: float
                   ) -> tuple[GenerationRequest, Callable[[Any], Any]]:
    """The request whose final event, and a function that makes any event, count load_s more
    in Usage.load_s: the time spent bringing the model up before the generation could start."""
    def add(event: Any) -> Any:
        if not isinstance(event, Done) or load_s <= 0:
            return event
        usage = event.usage
        return dataclasses.replace(event, usage=dataclasses.replace(
            usage, load_s=usage.load_s + load_s))

    on_final = request.on_final
    if on_final is not None:
        request = dataclasses.replace(request, on_final=lambda final: on_final(add(final)))
    return request, add


class ServiceFacade(Protocol):
    """The surface the API routes and the tray use."""

    @property
    def text(self) -> TextAssets:
        """TextAssets of the configured model (tokenizer, chat template); works unloaded.
        Raises ServiceError (503 not_started) before the service has read them."""

    @property
    def model_id(self) -> str: ...

    @property
    def context_tokens(self) -> int: ...

    @property
    def num_slots(self) -> int:
        """Cache slots of the model (--slots): valid slot ids are 0..num_slots-1."""

    @property
    def sampling_defaults(self) -> Any:
        """SamplingDefaults (engine/text/sampling_defaults.py) for fields a request leaves out."""

    def generate(self, request: GenerationRequest
                 ) -> AsyncGenerator[Tokens | Done | Error | PromptProgress, None]:
        """Queue a generation (up to `parallel` run at once, the rest wait FIFO), bring the
        engine up first if it is down.

        Raises ServiceError before the first event when it cannot start (503 engine failed or
        queue full, 400 bad request). Closing the iterator early cancels the generation.
        """

    async def embed(self, token_ids: Sequence[Sequence[int]], pooling: str) -> Embeddings:
        """One L2-normalized vector per token sequence (pooling: protocol.POOLINGS); brings
        the engine up first, as generate does. Raises ServiceError (400, 503)."""

    async def control(self, action: str, **kwargs: Any) -> dict[str, Any]:
        """A lifecycle action by name (load, unload, sleep, wake, release_experts, ...)."""

    async def forward_counts(self) -> Any:
        """protocol.ForwardCounts of the engine since the model's load, asked now (None while
        no engine runs); wakes nothing."""

    def set_unload_idle(self, seconds: float | None) -> None:
        """Unload after this many idle seconds from now on (None: never); Ollama's keep_alive."""

    def status(self) -> dict[str, Any]:
        """A snapshot for /v1/status, /health, /metrics; never wakes anything."""

    @property
    def state_listeners(self) -> list[Callable[[], None]]:
        """Called on the service loop whenever status() may have changed; no one polls."""
