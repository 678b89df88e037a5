"""Page-level memory from the OS, one API over three implementations, picked by platform.

- POSIX: anonymous private mmap; commit pre-faults (MADV_POPULATE_WRITE), decommit is
  madvise(MADV_DONTNEED): pages go back, the address stays, reads give zeros.
- Windows: VirtualAlloc(MEM_RESERVE) for the range, MEM_COMMIT per chunk, VirtualFree(MEM_DECOMMIT)
  gives the pages and the commit charge back; a recommitted page reads zeros. A decommitted page
  must not be read (an access violation), which arenas already forbid for released ranges.
- Fallback (neither available): a plain anonymous `mmap.mmap(-1, n)`; decommit zero-fills, so
  reads after a release give zeros as elsewhere, but the pages stay with the process.

The Windows calls go through ctypes to kernel32 rather than a package such as pywin32, which
would be a compiled dependency for four functions.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import sys
import weakref
from typing import Any, Protocol

log = logging.getLogger(__name__)

# Linux >= 5.14; Python 3.11's mmap module does not name it yet.
_MADV_POPULATE_WRITE = 23
_ZERO_BLOCK_BYTES = 1 << 20

MEM_COMMIT, MEM_RESERVE, MEM_DECOMMIT, MEM_RELEASE = 0x1000, 0x2000, 0x4000, 0x8000
PAGE_READWRITE = 0x04
_ERROR_NOT_ENOUGH_MEMORY, _ERROR_COMMITMENT_LIMIT = 8, 1455


class PagesOutOfMemory(MemoryError):
    """The OS had no memory (or commit charge) for the pages asked for."""


class PageRange(Protocol):
    """A page-aligned address range; `buffer` exports all of it for torch.frombuffer."""

    address: int
    size_bytes: int
    buffer: Any
    releases_pages: bool  # False for the fallback: decommit only zero-fills
    is_readable_when_decommitted: bool  # False on Windows: touching one is an access violation

    def commit(self, offset_bytes: int, size_bytes: int) -> None:
        """Back [offset, offset+size) with memory now; raises PagesOutOfMemory."""

    def decommit(self, offset_bytes: int, size_bytes: int) -> None:
        """Give [offset, offset+size)'s pages back; after a commit they read zeros."""

    def close(self) -> None:
        """Give the range back; the memory goes once no tensor views it any more."""


class PosixPages:
    """Anonymous private mmap: pages appear on first touch, madvise gives them back."""

    releases_pages = True
    is_readable_when_decommitted = True
    _can_populate = True  # shared: the kernel either knows MADV_POPULATE_WRITE or it does not

    def __init__(self, size_bytes: int):
        self.size_bytes = size_bytes
        self._mmap = mmap.mmap(-1, size_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.buffer = self._mmap
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))

    def commit(self, offset_bytes: int, size_bytes: int) -> None:
        if not PosixPages._can_populate:
            return
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE, offset_bytes, size_bytes)
        except OSError as exc:
            if exc.errno == errno.ENOMEM:
                # Give back whatever got populated before the OS ran out.
                self._mmap.madvise(mmap.MADV_DONTNEED, offset_bytes, size_bytes)
                raise PagesOutOfMemory("the OS has no free RAM for it") from exc
            # Older kernels (EINVAL): pages fault in on first write instead.
            log.debug("MADV_POPULATE_WRITE unavailable (%s); pages fault in on touch", exc)
            PosixPages._can_populate = False

    def decommit(self, offset_bytes: int, size_bytes: int) -> None:
        self._mmap.madvise(mmap.MADV_DONTNEED, offset_bytes, size_bytes)

    def close(self) -> None:
        _close_mmap(self._mmap, self.size_bytes)


class FallbackPages:
    """Plain anonymous mmap for platforms with neither madvise nor VirtualAlloc."""

    releases_pages = False
    is_readable_when_decommitted = True

    def __init__(self, size_bytes: int):
        self.size_bytes = size_bytes
        self._mmap = mmap.mmap(-1, size_bytes)
        self.buffer = self._mmap
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))

    def commit(self, offset_bytes: int, size_bytes: int) -> None:
        """Anonymous mmap is usable from the start."""

    def decommit(self, offset_bytes: int, size_bytes: int) -> None:
        zeros = bytes(min(size_bytes, _ZERO_BLOCK_BYTES))
        end = offset_bytes + size_bytes
        for start in range(offset_bytes, end, len(zeros)):
            stop = min(start + len(zeros), end)
            self._mmap[start:stop] = zeros[: stop - start]

    def close(self) -> None:
        _close_mmap(self._mmap, self.size_bytes)


def _close_mmap(mm: mmap.mmap, size_bytes: int) -> None:
    try:
        mm.close()
    except BufferError:
        # Live tensor views export the buffer; the mapping goes when the last one does.
        log.debug("mmap of %d bytes still viewed by tensors; freed by GC", size_bytes)


class Kernel32:
    """The two kernel32 calls used, with the calling convention spelled out for ctypes."""

    def __init__(self, dll: Any = None, last_error: Any = None):
        if dll is None:
            dll = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
            last_error = ctypes.get_last_error  # type: ignore[attr-defined]
        self.last_error = last_error
        self.VirtualAlloc = dll.VirtualAlloc
        self.VirtualAlloc.restype = ctypes.c_void_p
        self.VirtualAlloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
                                      ctypes.c_uint32]
        self.VirtualFree = dll.VirtualFree
        self.VirtualFree.restype = ctypes.c_int
        self.VirtualFree.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32]


class WindowsPages:
    """VirtualAlloc: reserve the range, commit and decommit chunks of it, release at the end."""

    releases_pages = True
    is_readable_when_decommitted = False

    def __init__(self, size_bytes: int, kernel32: Kernel32, is_committed: bool = False):
        self.size_bytes = size_bytes
        self._k32 = kernel32
        flags = MEM_RESERVE | (MEM_COMMIT if is_committed else 0)
        address = kernel32.VirtualAlloc(None, size_bytes, flags, PAGE_READWRITE)
        if not address:
            raise _windows_error("VirtualAlloc(MEM_RESERVE)", size_bytes, kernel32.last_error())
        self.address = int(address)
        # The array is what tensors keep alive; the range is released when the last one goes.
        self.buffer = (ctypes.c_ubyte * size_bytes).from_address(self.address)
        weakref.finalize(self.buffer, _virtual_release, kernel32, self.address)

    def commit(self, offset_bytes: int, size_bytes: int) -> None:
        address = self._k32.VirtualAlloc(self.address + offset_bytes, size_bytes, MEM_COMMIT,
                                         PAGE_READWRITE)
        if not address:
            raise _windows_error("VirtualAlloc(MEM_COMMIT)", size_bytes, self._k32.last_error())

    def decommit(self, offset_bytes: int, size_bytes: int) -> None:
        if not self._k32.VirtualFree(self.address + offset_bytes, size_bytes, MEM_DECOMMIT):
            code = self._k32.last_error()
            raise OSError(f"VirtualFree(MEM_DECOMMIT) of {size_bytes} bytes failed: error {code}")

    def close(self) -> None:
        self.buffer = None  # the finalizer releases the range once no tensor views it


def _virtual_release(kernel32: Kernel32, address: int) -> None:
    if not kernel32.VirtualFree(address, 0, MEM_RELEASE):
        log.warning("VirtualFree(MEM_RELEASE) at %#x failed: error %s", address,
                    kernel32.last_error())


def _windows_error(call: str, size_bytes: int, code: int) -> OSError:
    detail = f"{call} of {size_bytes} bytes failed: error {code}"
    if code in (_ERROR_NOT_ENOUGH_MEMORY, _ERROR_COMMITMENT_LIMIT):
        return PagesOutOfMemory(detail + " (not enough memory or page file)")
    return OSError(detail)


_kernel32: Kernel32 | None = None


def implementation() -> str:
    """Which implementation this platform gets: "windows", "posix" or "fallback"."""
    if sys.platform == "win32":
        return "windows"
    has_posix = all(hasattr(mmap, name) for name in ("MAP_PRIVATE", "MAP_ANONYMOUS", "MADV_DONTNEED"))
    return "posix" if has_posix and hasattr(mmap.mmap, "madvise") else "fallback"


def reserve(size_bytes: int) -> PageRange:
    """An address range with no memory committed yet; commit chunks before touching them."""
    return _open(size_bytes, is_committed=False)


def allocate(size_bytes: int) -> PageRange:
    """A committed, readable and writable range of its own pages (a host copy's buffer)."""
    return _open(size_bytes, is_committed=True)


def _open(size_bytes: int, is_committed: bool) -> PageRange:
    global _kernel32
    if size_bytes <= 0:
        raise ValueError(f"size_bytes must be positive, got {size_bytes}")
    kind = implementation()
    if kind == "windows":
        _kernel32 = _kernel32 or Kernel32()
        return WindowsPages(size_bytes, _kernel32, is_committed)
    return PosixPages(size_bytes) if kind == "posix" else FallbackPages(size_bytes)


PAGE_SIZE_BYTES = mmap.PAGESIZE
