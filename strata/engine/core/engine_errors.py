"""The engine's user-facing errors; `code` names the protocol error the process answers with."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from strata.engine.core.memory.arena import ArenaMapError
from strata.errors import StrataError
from strata.units import MIB


class EngineError(StrataError):
    """A request the engine cannot serve as asked; the message says why."""


class LevelNotApplicable(EngineError):
    """A lifecycle level that does not apply to this model (no expert cache, option off)."""

    code = "not_applicable"


class EngineOutOfMemory(EngineError):
    """Memory could not be mapped back (another process holds the VRAM); nothing was lost."""

    code = "out_of_memory"

    def __init__(self, message: str, missing_bytes: int = 0):
        super().__init__(message)
        self.missing_bytes = missing_bytes


class EngineBusy(EngineError):
    """A level change while a generation holds a slot."""

    code = "busy"


@contextmanager
def kv_mapping(what: str) -> Iterator[None]:
    """Turn a failed KV page mapping into out_of_memory with the missing MiB."""
    try:
        yield
    except ArenaMapError as exc:
        raise EngineOutOfMemory(
            f"{what}: {exc.missing_bytes / MIB:.0f} MiB of VRAM missing; free VRAM and retry",
            exc.missing_bytes,
        ) from exc
