"""OS pages: every implementation gives pages back and reads zeros after a recommit.

The Windows implementation runs here over `LibcKernel32`, VirtualAlloc's semantics built from
mmap/mprotect/madvise (reserved and decommitted pages are inaccessible, a commit gives zeroed
pages): it checks the ctypes calls, flags, offsets and error mapping, not kernel32 itself.
"""

import ctypes
import ctypes.util
import sys

import psutil
import pytest
import torch
from memory_helpers import MIB, random_bytes

from strata.engine.core.memory import os_pages
from strata.engine.core.memory.arena import Arena, ArenaMapError
from strata.engine.core.memory.backend import BackendOutOfMemory
from strata.engine.core.memory.cpu_mmap import CpuMmapBackend
from strata.engine.core.memory.host_copy import HostCopy

_PROT_NONE, _PROT_RW = 0, 3
_MAP_PRIVATE, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x02, 0x20, 0x4000
_MADV_DONTNEED = 4


class LibcKernel32:
    """VirtualAlloc/VirtualFree as Linux system calls, recording every call made."""

    def __init__(self, fail_commit_with: int | None = None):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self._mmap, self._mprotect, self._madvise = libc.mmap, libc.mprotect, libc.madvise
        self._munmap = libc.munmap
        self._mmap.restype = ctypes.c_void_p
        self._mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_long]
        for fn in (self._mprotect, self._madvise):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.reserved: dict[int, int] = {}
        self.calls: list[tuple[str, int, int, int]] = []
        self.fail_commit_with = fail_commit_with
        self.error = 0
        # Real ctypes function pointers, so os_pages sets restype/argtypes and converts through
        # ctypes exactly as it does for kernel32's exports.
        self.VirtualAlloc = ctypes.CFUNCTYPE(
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_uint32
        )(self._virtual_alloc)
        self.VirtualFree = ctypes.CFUNCTYPE(
            ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32
        )(self._virtual_free)

    def last_error(self) -> int:
        return self.error

    def _virtual_alloc(self, address, size, flags, protect):
        assert protect == os_pages.PAGE_READWRITE
        self.calls.append(("alloc", address or 0, size, flags))
        if address is None:
            assert flags & os_pages.MEM_RESERVE
            prot = _PROT_RW if flags & os_pages.MEM_COMMIT else _PROT_NONE
            base = self._mmap(None, size, prot, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE,
                              -1, 0)
            self.reserved[base] = size
            return base
        assert flags == os_pages.MEM_COMMIT and self._inside(address, size)
        if self.fail_commit_with is not None:
            self.error = self.fail_commit_with
            return None
        assert self._mprotect(address, size, _PROT_RW) == 0
        return address

    def _virtual_free(self, address, size, flags):
        self.calls.append(("free", address, size, flags))
        if flags == os_pages.MEM_RELEASE:
            assert size == 0 and address in self.reserved
            return int(self._munmap(address, self.reserved.pop(address)) == 0)
        assert flags == os_pages.MEM_DECOMMIT and self._inside(address, size)
        ok = self._madvise(address, size, _MADV_DONTNEED) == 0
        return int(ok and self._mprotect(address, size, _PROT_NONE) == 0)

    def _inside(self, address: int, size: int) -> bool:
        return any(b <= address and address + size <= b + n for b, n in self.reserved.items())


@pytest.fixture
def windows(monkeypatch):
    """os_pages as it runs on Windows, over LibcKernel32."""
    if not sys.platform.startswith("linux"):
        pytest.skip("LibcKernel32 is built from Linux system calls")
    fake = LibcKernel32()
    monkeypatch.setattr(os_pages, "implementation", lambda: "windows")
    monkeypatch.setattr(os_pages, "_kernel32", os_pages.Kernel32(fake, fake.last_error))
    return fake


def _rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("kind", ["native", "fallback"])
def test_decommit_then_commit_reads_zeros(kind, monkeypatch):
    if kind == "fallback":
        monkeypatch.setattr(os_pages, "implementation", lambda: "fallback")
    pages = os_pages.reserve(8 * MIB)
    view = torch.frombuffer(pages.buffer, dtype=torch.uint8)
    assert view.data_ptr() == pages.address and pages.address % os_pages.PAGE_SIZE_BYTES == 0
    pages.commit(0, 8 * MIB)
    view.copy_(random_bytes(8 * MIB, seed=3))
    pages.decommit(2 * MIB, 4 * MIB)
    pages.commit(2 * MIB, 4 * MIB)
    assert int(view[2 * MIB : 6 * MIB].count_nonzero()) == 0
    assert int(view[: 2 * MIB].count_nonzero()) > 0 and int(view[6 * MIB :].count_nonzero()) > 0
    del view
    pages.close()


def test_native_decommit_gives_pages_back():
    if not os_pages.reserve(os_pages.PAGE_SIZE_BYTES).releases_pages:
        pytest.skip("the portable fallback (no madvise, not Windows) only zero-fills")
    pages = os_pages.reserve(128 * MIB)
    pages.commit(0, 128 * MIB)
    torch.frombuffer(pages.buffer, dtype=torch.uint8).fill_(1)
    before = _rss()
    pages.decommit(0, 128 * MIB)
    assert before - _rss() >= 120 * MIB
    pages.close()


def test_windows_commit_decommit_release_calls(windows):
    pages = os_pages.reserve(8 * MIB)
    base = pages.address
    assert windows.calls == [("alloc", 0, 8 * MIB, os_pages.MEM_RESERVE)]
    pages.commit(2 * MIB, 2 * MIB)
    view = torch.frombuffer(pages.buffer, dtype=torch.uint8)
    view[2 * MIB : 4 * MIB].fill_(9)
    before = _rss()
    pages.decommit(2 * MIB, 2 * MIB)
    assert before - _rss() >= MIB  # the pages really went back
    pages.commit(2 * MIB, 2 * MIB)
    assert int(view[2 * MIB : 4 * MIB].count_nonzero()) == 0
    assert windows.calls[1:] == [
        ("alloc", base + 2 * MIB, 2 * MIB, os_pages.MEM_COMMIT),
        ("free", base + 2 * MIB, 2 * MIB, os_pages.MEM_DECOMMIT),
        ("alloc", base + 2 * MIB, 2 * MIB, os_pages.MEM_COMMIT),
    ]
    pages.close()
    assert base in windows.reserved  # a tensor still views it: not released under it
    del view
    assert base not in windows.reserved and windows.calls[-1] == (
        "free", base, 0, os_pages.MEM_RELEASE)


def test_windows_commit_failure_is_out_of_memory(windows):
    windows.fail_commit_with = 1455  # ERROR_COMMITMENT_LIMIT: the page file is full
    backend = CpuMmapBackend()
    arena = Arena("experts", 4 * MIB, backend, chunk_bytes=2 * MIB)
    with pytest.raises(ArenaMapError, match="error 1455") as caught:
        arena.map()
    assert isinstance(caught.value.__cause__, BackendOutOfMemory)
    assert arena.resident_bytes == 0 and backend.resident_bytes == 0


def test_arena_and_host_copy_lifecycle_on_windows_pages(windows):
    arena = Arena("weights", 8 * MIB, CpuMmapBackend(), chunk_bytes=2 * MIB)
    arena.map()
    content = random_bytes(8 * MIB, seed=5)
    arena.tensor(0, (8 * MIB,), torch.uint8).copy_(content)
    host = HostCopy.snapshot(arena)
    assert ("alloc", 0, 8 * MIB, os_pages.MEM_RESERVE | os_pages.MEM_COMMIT) in windows.calls
    arena.release()
    decommits = [c for c in windows.calls if c[0] == "free" and c[3] == os_pages.MEM_DECOMMIT]
    assert sum(c[2] for c in decommits) == 8 * MIB
    arena.refill()
    assert torch.equal(arena.tensor(0, (8 * MIB,), torch.uint8), content)
    arena.close()
    host.close()
