"""Host copies: RAM buffers that mirror an arena's content so a release loses nothing.

The buffer is filled as ordinary memory first and pinned afterwards by registering it with the
driver (8 GiB in 0.36 s, against seconds for allocating pinned memory), once, never per
release. Copies run in chunks of >= 16 MiB on a side stream, where they reach the PCIe limit.
A copy that a GPU reads in place (the experts) asks for its pages on that GPU's NUMA node
before they are first touched (numa.py), and records where they landed.
"""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from dataclasses import dataclass

import torch

from strata.engine.core.memory import numa, os_pages
from strata.engine.core.memory.arena import Arena
from strata.engine.core.memory.backend import cuda_available
from strata.units import MIB

log = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 64 * MIB
MIN_COPY_CHUNK_BYTES = 16 * MIB  # below this, per-copy overhead eats PCIe bandwidth

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


@dataclass(frozen=True)
class CopyStats:
    """One copy between host and arena: bytes moved and wall seconds (synchronized)."""

    nbytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per device, so copies overlap compute on torch's current stream."""
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


def copy_chunked(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int = COPY_CHUNK_BYTES) -> None:
    """dst.copy_(src) for flat uint8 tensors, in chunks, on the side stream when on a GPU.

    Returns when the data has arrived (the side stream is synchronized)."""
    if chunk_bytes < MIN_COPY_CHUNK_BYTES:
        raise ValueError(f"copy chunks of {chunk_bytes} bytes are below the 16 MiB minimum")
    gpu = dst.device if dst.is_cuda else src.device if src.is_cuda else None
    nbytes = dst.numel()
    if gpu is None:
        for start in range(0, nbytes, chunk_bytes):
            dst[start : start + chunk_bytes].copy_(src[start : start + chunk_bytes])
        return
    stream = side_stream(gpu)
    stream.wait_stream(torch.cuda.current_stream(gpu))  # see writes queued before this copy
    with torch.cuda.stream(stream):
        for start in range(0, nbytes, chunk_bytes):
            dst[start : start + chunk_bytes].copy_(
                src[start : start + chunk_bytes], non_blocking=True
            )
    stream.synchronize()


def _unregister(address: int) -> None:
    from cuda.bindings import driver as cu

    (err,) = cu.cuMemHostUnregister(address)
    if err == cu.CUresult.CUDA_ERROR_CONTEXT_IS_DESTROYED:
        return  # an unload reset the context (Engine.close_for_exit): the registration went with it
    if err != cu.CUresult.CUDA_SUCCESS:
        log.warning("cuMemHostUnregister of host copy at %#x failed: %s", address, err)


class HostCopy:
    """A page-aligned host buffer of size_bytes mirroring [0, size_bytes) of an arena."""

    def __init__(self, size_bytes: int, name: str = "host copy", near_device: int | None = None):
        """near_device: a CUDA device index whose NUMA node the pages should be on (asked
        before they are first touched; a no-op where that cannot be done, see numa.place_near)."""
        if size_bytes <= 0:
            raise ValueError(f"{name}: size_bytes must be positive, got {size_bytes}")
        self.name = name
        self.size_bytes = size_bytes
        # Its own pages (anonymous mmap, VirtualAlloc on Windows): page-aligned, and no page
        # shared with other allocations that someone else might register for pinning too.
        self._pages = os_pages.allocate(size_bytes)
        self.placement = numa.Placement(None, "default", "not placed", {})
        if near_device is not None:
            self.placement = numa.place_near(self._pages.address, size_bytes,
                                             numa.gpu_numa_node(near_device))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._buffer = torch.frombuffer(self._pages.buffer, dtype=torch.uint8)
        self.is_pinned = False
        self.pin_note = "not pinned"
        # Where kernels on the device read this buffer (mapped over PCIe once pinned); on the
        # CPU the buffer itself, None on a GPU until pinning succeeds.
        self.device_address: int | None = self._buffer.data_ptr()
        self._unpin: weakref.finalize | None = None
        self._is_closed = False

    @classmethod
    def snapshot(cls, arena: Arena, nbytes: int | None = None, pin: bool = True) -> HostCopy:
        """Copy [0, nbytes) of a mapped arena (default: its allocated bytes) to a new host copy,
        pin it when the arena is on a GPU, and attach it so refill() restores it."""
        nbytes = nbytes or arena.allocated_bytes or arena.reserved_bytes
        host = cls(nbytes, name=f"host copy of {arena.name}")
        host.copy_from(arena)
        if pin and arena.device.type == "cuda":
            host.pin(arena.device.index or 0)
        arena.attach_host_copy(host)
        return host

    def tensor(
        self, offset_bytes: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype
    ) -> torch.Tensor:
        """A view of the buffer for filling it (e.g. with weights laid out like the arena)."""
        numel = 1
        for dim in shape:
            numel *= int(dim)
        end = offset_bytes + numel * dtype.itemsize
        if offset_bytes < 0 or end > self.size_bytes or offset_bytes % dtype.itemsize:
            raise ValueError(
                f"{self.name}: view [{offset_bytes}, {end}) of {dtype} is misaligned or outside "
                f"its {self.size_bytes} bytes"
            )
        return self._buffer[offset_bytes:end].view(dtype).view(tuple(shape))

    def device_address_of(self, view: torch.Tensor) -> int | None:
        """Where a kernel on the device reads `view` (a tensor() of this buffer) in place;
        None where it cannot (a GPU and a pageable buffer)."""
        offset = view.data_ptr() - self._buffer.data_ptr()
        if not 0 <= offset < self.size_bytes:
            raise ValueError(f"{self.name}: the tensor at {view.data_ptr():#x} is not a view of it")
        return None if self.device_address is None else self.device_address + offset

    def pin(self, device_index: int = 0) -> bool:
        """Page-lock the (already filled) buffer by registering it; False, with pin_note saying
        why, when there is no CUDA or the OS refuses (the copy then stays pageable, slower)."""
        if self.is_pinned:
            return True
        self.device_address = None  # a GPU cannot read pageable memory
        if not cuda_available():
            self.pin_note = "no CUDA driver: host copy stays pageable"
            return False
        from cuda.bindings import driver as cu

        from strata.engine.core.memory.cuda_vmm import error_text, primary_context

        primary_context(device_index)
        address = self._buffer.data_ptr()
        # DEVICEMAP: kernels may read experts straight from here (zero-copy) while a cache
        # does not hold them; PORTABLE: every context sees the pinning.
        flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        (err,) = cu.cuMemHostRegister(address, self.size_bytes, flags)
        if err != cu.CUresult.CUDA_SUCCESS:
            self.pin_note = f"cuMemHostRegister refused ({error_text(err)}): stays pageable"
            log.warning("%s of %d MiB: %s", self.name, self.size_bytes // MIB, self.pin_note)
            return False
        self.is_pinned = True
        self.pin_note = "pinned by cuMemHostRegister"
        self.sample_placement()  # filled by now: where its pages landed stays put while pinned
        self._unpin = weakref.finalize(self, _unregister, address)
        err, device_pointer = cu.cuMemHostGetDevicePointer(address, 0)
        if err == cu.CUresult.CUDA_SUCCESS:
            self.device_address = int(device_pointer)
        else:
            log.warning("%s: no device address (%s): kernels cannot read it in place",
                        self.name, error_text(err))
        return True

    def sample_placement(self) -> numa.Placement:
        """Record (in `placement`) which NUMA nodes a sample of the buffer's pages sit on."""
        self.placement = numa.sampled_placement(self.placement, self._pages.address,
                                                self.size_bytes)
        return self.placement

    def copy_to(self, arena: Arena, offset_bytes: int = 0, nbytes: int | None = None) -> CopyStats:
        """Host -> arena for [offset, offset + nbytes); the arena range must be mapped."""
        nbytes = self.size_bytes - offset_bytes if nbytes is None else nbytes
        dst = arena.tensor(offset_bytes, (nbytes,), torch.uint8)  # raises if released
        t0 = time.perf_counter()
        copy_chunked(dst, self._buffer[offset_bytes : offset_bytes + nbytes])
        return CopyStats(nbytes, time.perf_counter() - t0)

    def copy_from(
        self, arena: Arena, offset_bytes: int = 0, nbytes: int | None = None
    ) -> CopyStats:
        """Arena -> host for [offset, offset + nbytes); the arena range must be mapped."""
        nbytes = self.size_bytes - offset_bytes if nbytes is None else nbytes
        src = arena.tensor(offset_bytes, (nbytes,), torch.uint8)
        t0 = time.perf_counter()
        copy_chunked(self._buffer[offset_bytes : offset_bytes + nbytes], src)
        return CopyStats(nbytes, time.perf_counter() - t0)

    def count_differing_chunks(self, arena: Arena, chunk_bytes: int = COPY_CHUNK_BYTES) -> int:
        """How many chunks of the arena differ from this copy (0: byte-identical)."""
        differing = 0
        for start in range(0, self.size_bytes, chunk_bytes):
            size = min(chunk_bytes, self.size_bytes - start)
            device_part = arena.tensor(start, (size,), torch.uint8)
            host_part = self._buffer[start : start + size].to(
                device_part.device, non_blocking=False
            )
            differing += int(not torch.equal(device_part, host_part))
        return differing

    def close(self) -> None:
        """Unpin and free the buffer (views of it must be gone for the memory to return)."""
        if self._is_closed:
            return
        self._is_closed = True
        self.device_address = None
        if self._unpin is not None:
            self._unpin()
            self.is_pinned = False
        del self._buffer
        self._pages.close()  # the memory goes once no tensor views it any more
