"""Give the C heap's free pages back to the OS once the engine has nothing to do.

glibc keeps what a process frees in its heap, and after the first large block is freed it
raises its mmap threshold (up to 32 MiB), so later activations of that size come from the
heap too. A long prompt on the CPU then leaves its activations' pages resident after the
request: the engine of `strata serve --device cpu` held 1.79 GB after one 7,230-token prompt
on SmolLM2-135M, about 0.9 GB more than its weights and KV (issue 51 item 8). malloc_trim(0)
hands the free pages back (madvise on free chunks inside the heap, not only its top); it takes
milliseconds, so the engine calls it when it goes idle after work, never between steps.
Elsewhere (macOS, Windows, musl) there is no malloc_trim and this does nothing.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from functools import cache


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)  # musl has none
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def trim_heap() -> bool:
    """Return the heap's free pages to the OS; True where the C library could do it."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
