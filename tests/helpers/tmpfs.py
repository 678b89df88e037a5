"""A small real tmpfs for storage-fault tests: fill it for ENOSPC, remount it read-only for EROFS.

Mounting needs root and CAP_SYS_ADMIN (CI's container has both); elsewhere the tests skip.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(directory: Path, size_kib: int = 256) -> Iterator[Path]:
    """Mount a tmpfs of size_kib at directory for the duration; skip the test if we cannot."""
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs",
                              str(directory)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, check=False)


def fill(directory: Path) -> None:
    """Write a filler file until the file system answers ENOSPC."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)


def remount_read_only(directory: Path) -> None:
    """Turn the mounted tmpfs read-only (EROFS on every write)."""
    subprocess.run(["mount", "-o", "remount,ro", str(directory)], check=True,
                   capture_output=True)
