"""Services over the fake engine, wired like `strata serve` builds them, for lifecycle tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fakes.fake_engine import FAKE_ENGINE_FACTORY, MIB, FakeEngineConfig
from strata.engine.protocol import SamplingSpec
from strata.engine.service.facade import GenerationRequest
from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings

EXPERT_BYTES = 32 * MIB
WEIGHTS_BYTES = 64 * MIB


def make_service(model_dir, *, engine: dict[str, Any] | None = None,
                 vram_reader=lambda: None, **settings: Any) -> Service:
    """A Service over the fake engine; `engine` sets FakeEngineConfig knobs, the rest settings."""
    engine_config = FakeEngineConfig(model_path=str(model_dir), weights_bytes=WEIGHTS_BYTES,
                                     **(engine or {}))
    options = {k: settings.pop(k) for k in ("keep_standby", "before_load_timeout_s")
               if k in settings}
    return Service(ServeSettings(model=str(model_dir), **settings),
                   engine_factory=FAKE_ENGINE_FACTORY, engine_config=engine_config,
                   supervisor_options={"backoff_base_s": 0.2, "backoff_max_s": 0.4},
                   vram_reader=vram_reader, **options)


def moe(**knobs: Any) -> dict[str, Any]:
    """Fake engine knobs of a MoE model (an expert cache of EXPERT_BYTES)."""
    return {"expert_bytes": EXPERT_BYTES, **knobs}


def request(prompt: Sequence[int], max_tokens: int = 6, slot: int = 0) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingSpec(max_tokens=max_tokens), slot)


async def answer(service: Service, prompt: Sequence[int], max_tokens: int = 6, slot: int = 0):
    """(token ids, usage) of one generation."""
    ids, usage = [], None
    async for event in service.generate(request(prompt, max_tokens, slot)):
        ids.extend(getattr(event, "token_ids", ()))
        usage = getattr(event, "usage", usage)
        if hasattr(event, "code"):
            raise AssertionError(f"the engine answered an error: {event.code}: {event.message}")
    return ids, usage
