"""An arena: one reserved address range whose physical memory comes and goes in chunks.

The address never changes, so tensors (and CUDA graphs captured over them) made once stay valid
across release and refill. Nothing may touch an arena while its memory is released: every entry
point that hands out or fills memory calls `check_mapped` first, turning what would be a kernel
fault on the GPU into a Python error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Self

import torch

from strata.engine.core.memory.backend import (
    MIB,
    ArenaBackend,
    BackendOutOfMemory,
    backend_for,
    cuda_available,
    round_up,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "Arena",
    "ArenaError",
    "ArenaFullError",
    "ArenaMapError",
    "ArenaReleasedError",
    "RefillResult",
    "backend_for",
    "cuda_available",
]

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 256 * MIB


class HostContent(Protocol):
    """What refill() copies back from: host_copy.HostCopy (which builds on Arena, so the arena
    names only what it calls)."""

    size_bytes: int

    def copy_to(self, arena: Arena, offset_bytes: int = 0, nbytes: int | None = None) -> Any:
        """Copy [offset, offset + nbytes) into the mapped arena; the result has .nbytes."""


MAPPED, PARTIAL, RELEASED = "mapped", "partial", "released"


class ArenaError(RuntimeError):
    """Base of the arena errors; the message says what failed and what to do."""


class ArenaReleasedError(ArenaError):
    """Something tried to use arena memory that is not mapped."""


class ArenaFullError(ArenaError):
    """The bump allocator ran past the reserved range."""


class ArenaMapError(ArenaError):
    """Mapping failed for lack of memory; nothing of the attempt stays mapped. A load that
    meets it is a refusal the host retries (another program holds the VRAM), not a bad model."""

    code = "out_of_memory"  # the protocol error the engine process answers

    def __init__(self, message: str, arena_name: str, missing_bytes: int):
        super().__init__(message)
        self.arena_name = arena_name
        self.missing_bytes = missing_bytes


@dataclass(frozen=True)
class RefillResult:
    """What a refill did: bytes mapped and copied back, and how long each part took."""

    mapped_bytes: int
    copied_bytes: int
    map_s: float
    copy_s: float


class Arena:
    """A named, fixed-address memory range mapped in chunks of `chunk_bytes` on a backend."""

    def __init__(
        self,
        name: str,
        size_bytes: int,
        backend: ArenaBackend,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ):
        if size_bytes <= 0 or chunk_bytes <= 0:
            raise ValueError(
                f"arena {name!r}: size_bytes ({size_bytes}) and chunk_bytes ({chunk_bytes}) "
                "must be positive"
            )
        granularity = backend.granularity_bytes
        self.name = name
        self.backend = backend
        self.reserved_bytes = round_up(size_bytes, granularity)
        self.chunk_bytes = round_up(min(chunk_bytes, self.reserved_bytes), granularity)
        self._reservation = backend.reserve(self.reserved_bytes)
        num_chunks = -(-self.reserved_bytes // self.chunk_bytes)
        self._handles: list[Any] = [None] * num_chunks
        self._held_content = [False] * num_chunks  # unmapped by a release, not never mapped
        self._allocated_bytes = 0
        self.host_copy: HostContent | None = None
        self._is_closed = False

    # ---- state ----------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def base_address(self) -> int:
        return self._reservation.base_address

    @property
    def state(self) -> str:
        """'mapped' (all chunks), 'released' (none), 'partial' (some, e.g. a growing KV) or
        'closed' (unloaded)."""
        if self._is_closed:
            return "closed"
        num_mapped = sum(h is not None for h in self._handles)
        if num_mapped == len(self._handles):
            return MAPPED
        return RELEASED if num_mapped == 0 else PARTIAL

    @property
    def resident_bytes(self) -> int:
        return sum(self._chunk_size(i) for i, h in enumerate(self._handles) if h is not None)

    @property
    def released_bytes(self) -> int:
        """Bytes that held content and were given back by a release (what a refill restores)."""
        return sum(self._chunk_size(i) for i, held in enumerate(self._held_content) if held)

    @property
    def allocated_bytes(self) -> int:
        return self._allocated_bytes

    def _chunk_size(self, index: int) -> int:
        return min(self.chunk_bytes, self.reserved_bytes - index * self.chunk_bytes)

    def _chunk_span(self, offset_bytes: int, nbytes: int) -> range:
        """Indices of the chunks that overlap [offset, offset + nbytes)."""
        if offset_bytes < 0 or nbytes < 0 or offset_bytes + nbytes > self.reserved_bytes:
            raise ValueError(
                f"arena {self.name!r}: range [{offset_bytes}, {offset_bytes + nbytes}) lies "
                f"outside its {self.reserved_bytes} reserved bytes"
            )
        if nbytes == 0:
            return range(0)
        return range(
            offset_bytes // self.chunk_bytes, -(-(offset_bytes + nbytes) // self.chunk_bytes)
        )

    def check_mapped(self, offset_bytes: int = 0, nbytes: int | None = None) -> None:
        """Raise ArenaReleasedError unless every byte of the range (default: all) is mapped."""
        if self._is_closed:
            raise ArenaReleasedError(f"arena {self.name!r} is closed: the model was unloaded")
        nbytes = self.reserved_bytes - offset_bytes if nbytes is None else nbytes
        unmapped = [i for i in self._chunk_span(offset_bytes, nbytes) if self._handles[i] is None]
        if not unmapped:
            return
        if self.state == RELEASED:
            raise ArenaReleasedError(f"arena {self.name!r} is released: refill it before use")
        start, end = unmapped[0] * self.chunk_bytes, (unmapped[-1] + 1) * self.chunk_bytes
        raise ArenaReleasedError(
            f"arena {self.name!r}: bytes [{start}, {min(end, self.reserved_bytes)}) are not "
            "mapped: ensure_mapped() them before use"
        )

    # ---- mapping --------------------------------------------------------------------------

    def map(self) -> int:
        """Map every chunk (content undefined); returns the bytes newly mapped."""
        return self.map_range(0, self.reserved_bytes)

    def ensure_mapped(self, up_to_bytes: int) -> int:
        """Map the chunks covering [0, up_to_bytes), e.g. as a KV cache grows."""
        return self.map_range(0, up_to_bytes)

    def map_range(self, offset_bytes: int, nbytes: int) -> int:
        """Map the unmapped chunks that overlap the range; on failure undo this call's mappings.

        Raises ArenaMapError (with missing_bytes) when the memory is not there.
        """
        if self._is_closed:
            raise ArenaReleasedError(f"arena {self.name!r} is closed: the model was unloaded")
        todo = [i for i in self._chunk_span(offset_bytes, nbytes) if self._handles[i] is None]
        needed_bytes = sum(self._chunk_size(i) for i in todo)
        done: list[int] = []
        try:
            for i in todo:
                self._handles[i] = self.backend.map_chunk(
                    self._reservation, i * self.chunk_bytes, self._chunk_size(i)
                )
                done.append(i)
            for start, size in self._runs(done):  # one access call per contiguous run
                self.backend.set_access(self._reservation, start, size)
        except BackendOutOfMemory as exc:
            mapped_bytes = sum(self._chunk_size(i) for i in done)
            self._unmap(done)
            missing_bytes = needed_bytes - mapped_bytes
            raise ArenaMapError(
                f"arena {self.name!r}: could not map {needed_bytes / MIB:.0f} MiB, "
                f"{missing_bytes / MIB:.0f} MiB missing ({exc.detail}); free memory held by "
                "other processes and retry",
                self.name,
                missing_bytes,
            ) from exc
        except BaseException:
            self._unmap(done)
            raise
        for i in done:
            self._held_content[i] = False
        return needed_bytes

    def _runs(self, indices: list[int]) -> Iterator[tuple[int, int]]:
        """(offset, nbytes) of each contiguous run of chunk indices (sorted ascending)."""
        run: list[int] = []
        for i in [*indices, -1]:
            if run and i != run[-1] + 1:
                yield run[0] * self.chunk_bytes, sum(self._chunk_size(j) for j in run)
                run = []
            if i >= 0:
                run.append(i)

    def _unmap(self, indices: list[int]) -> None:
        for i in indices:
            handle, self._handles[i] = self._handles[i], None
            self.backend.unmap_chunk(
                self._reservation, i * self.chunk_bytes, self._chunk_size(i), handle
            )

    def release(self) -> int:
        """Synchronize, unmap and free every chunk; the range stays. Returns bytes freed."""
        return self.release_range(0, self.reserved_bytes)

    def release_from(self, offset_bytes: int) -> int:
        """Free the chunks that lie wholly at or after offset_bytes (a KV cache shrinking)."""
        start = min(round_up(offset_bytes, self.chunk_bytes), self.reserved_bytes)
        return self.release_range(start, self.reserved_bytes - start)

    def release_range(self, offset_bytes: int, nbytes: int, synchronize: bool = True) -> int:
        """Free the mapped chunks wholly inside the range; returns when the memory is free.

        synchronize=False skips the device-wide sync for a caller that knows nothing queued
        reads the range (an offload after the copy of those bytes completed): a sync per
        range would wait for the copies still queued behind it."""
        whole = [i for i in self._whole_chunks(offset_bytes, nbytes)
                 if self._handles[i] is not None]
        if not whole:
            return 0
        if synchronize:
            self.backend.synchronize()  # queued kernels may still read these pages
        self._unmap(whole)
        for i in whole:
            self._held_content[i] = True
        return sum(self._chunk_size(i) for i in whole)

    def _whole_chunks(self, offset_bytes: int, nbytes: int) -> list[int]:
        """Indices of the chunks wholly inside [offset, offset + nbytes)."""
        return [i for i in self._chunk_span(offset_bytes, nbytes)
                if i * self.chunk_bytes >= offset_bytes
                and i * self.chunk_bytes + self._chunk_size(i) <= offset_bytes + nbytes]

    def bytes_kept_by(self, released: Sequence[tuple[int, int]]) -> int:
        """What a fully mapped arena still maps after release_range over each (offset,
        nbytes): a chunk that also holds bytes outside those ranges stays whole."""
        freed = {i for offset, nbytes in released for i in self._whole_chunks(offset, nbytes)}
        return self.reserved_bytes - sum(self._chunk_size(i) for i in freed)

    def attach_host_copy(self, host_copy: HostContent) -> None:
        """Use host_copy as the content that refill() restores."""
        if host_copy.size_bytes > self.reserved_bytes:
            raise ValueError(
                f"arena {self.name!r}: host copy of {host_copy.size_bytes} bytes is larger "
                f"than the {self.reserved_bytes} reserved bytes"
            )
        self.host_copy = host_copy

    def refill(self, copy_from_host: bool = True) -> RefillResult:
        """Map what is unmapped, then copy its content back from the host copy (if any).

        On failure nothing of this attempt stays mapped and ArenaMapError says how much
        memory was missing; a later refill can succeed.
        """
        newly = [i for i, h in enumerate(self._handles) if h is None]
        t0 = time.perf_counter()
        mapped_bytes = self.map()
        t1 = time.perf_counter()
        copied_bytes = 0
        if copy_from_host and self.host_copy is not None:
            try:
                for start, size in self._runs(newly):
                    size = min(size, self.host_copy.size_bytes - start)
                    if size > 0:
                        copied_bytes += self.host_copy.copy_to(self, start, size).nbytes
            except BaseException:
                self._unmap(newly)  # half-copied content must not look valid
                raise
        return RefillResult(mapped_bytes, copied_bytes, t1 - t0, time.perf_counter() - t1)

    # ---- tensors --------------------------------------------------------------------------

    def tensor(
        self,
        offset_bytes: int,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        require_mapped: bool = True,
    ) -> torch.Tensor:
        """A zero-copy view of the arena at offset_bytes; its data_ptr never changes."""
        itemsize = dtype.itemsize
        if offset_bytes % itemsize:
            raise ValueError(
                f"arena {self.name!r}: offset {offset_bytes} is not aligned to {dtype}'s "
                f"{itemsize} bytes"
            )
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * itemsize
        if require_mapped:
            self.check_mapped(offset_bytes, nbytes)
        else:
            self._chunk_span(offset_bytes, nbytes)  # bounds check only
        raw = self._reservation.base_tensor[offset_bytes : offset_bytes + nbytes]
        return raw.view(dtype).view(tuple(shape))

    def allocate(
        self,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        align_bytes: int = 256,
        require_mapped: bool = True,
    ) -> torch.Tensor:
        """Lay out the next tensor (bump allocation, aligned); raises ArenaFullError past the end.

        require_mapped=False lays out over pages mapped later (KV ranges that grow)."""
        itemsize = dtype.itemsize
        numel = 1
        for dim in shape:
            numel *= int(dim)
        offset = round_up(self._allocated_bytes, max(align_bytes, itemsize))
        if offset + numel * itemsize > self.reserved_bytes:
            raise ArenaFullError(
                f"arena {self.name!r} is full: {numel * itemsize} bytes asked, "
                f"{self.reserved_bytes - offset} left of {self.reserved_bytes}; size it larger"
            )
        view = self.tensor(offset, shape, dtype, require_mapped=require_mapped)
        self._allocated_bytes = offset + numel * itemsize
        return view

    # ---- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Release everything and give the address range back; tensors over it become invalid."""
        if self._is_closed:
            return
        self.release()
        self.backend.free(self._reservation)
        self._is_closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Arena({self.name!r}, {self.state}, resident {self.resident_bytes / MIB:.0f} of "
            f"{self.reserved_bytes / MIB:.0f} MiB, {self.device})"
        )
