"""Snapshot files hold conversations: private files (0600) in a private directory (0700).

Temporary files get unpredictable names created with O_EXCL|O_NOFOLLOW (tempfile.mkstemp),
so a symlink planted at a guessed name cannot redirect a save onto another file. A snapshot
directory that another user owns, or that others may write into, is refused: whoever can
write there can swap in files. Reads open with O_NOFOLLOW|O_NONBLOCK and check fstat, so a
FIFO or device named like a snapshot is refused instead of blocking the engine.
POSIX-only steps (owner, modes, O_NOFOLLOW) are skipped where the OS lacks them (Windows).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

from strata.engine.core.snapshots.errors import SnapshotInvalid, SnapshotWriteError

DIR_MODE = 0o700  # files are 0600: mkstemp creates them so, and a rename keeps the mode
_IS_POSIX = hasattr(os, "getuid")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation


def prepare_dir(directory: Path, *, is_strata_own: bool = False) -> None:
    """Create `directory` (and missing parents) with mode 0700 and check that it is private.

    is_strata_own: Strata's default directory, which an older version made 0755: tightened
    to 0700. A directory the user named is never chmod'ed; refused when unsafe.
    Raises SnapshotWriteError (code storage_error) with what to do.
    """
    directory = Path(directory)
    try:
        directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        info = os.stat(directory)
    except OSError as exc:
        raise SnapshotWriteError.from_os_error(
            f"could not write KV snapshots into {directory}", exc) from exc
    if not stat.S_ISDIR(info.st_mode):
        raise SnapshotWriteError(f"the snapshot directory {directory} is not a directory; "
                                 "point --snapshot-dir at a directory")
    if not _IS_POSIX:
        return
    if info.st_uid != os.getuid():
        raise SnapshotWriteError(
            f"the snapshot directory {directory} belongs to another user (uid {info.st_uid}); "
            "snapshots hold conversations: use a directory of your own (--snapshot-dir)")
    is_shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if is_strata_own and stat.S_IMODE(info.st_mode) != DIR_MODE:
        try:
            os.chmod(directory, DIR_MODE)
            return
        except OSError as exc:
            if not is_shared:
                return  # readable by others is a privacy matter the 0600 files cover
            raise SnapshotWriteError.from_os_error(
                f"cannot make the snapshot directory {directory} private", exc) from exc
    if is_shared:
        raise SnapshotWriteError(
            f"the snapshot directory {directory} is writable by other users (mode "
            f"{stat.S_IMODE(info.st_mode):o}); run 'chmod 700 {directory}' or pick another "
            "--snapshot-dir")


def create_temp(directory: Path, name: str) -> tuple[BinaryIO, Path]:
    """A new private (0600) file with an unpredictable name next to `name`, opened for writing.

    mkstemp opens with O_CREAT|O_EXCL|O_NOFOLLOW: an existing file or symlink is never reused.
    """
    # A short prefix: a 255-character name plus mkstemp's suffix would be too long a name.
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{name[:64]}.", suffix=".tmp")
    return os.fdopen(fd, "wb"), Path(temp)


def open_regular(path: Path) -> BinaryIO:
    """Open a snapshot file for reading; SnapshotInvalid("missing") unless a regular file.

    O_NONBLOCK: opening a FIFO does not wait for a writer; O_NOFOLLOW: no symlinks.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _BINARY)
    except FileNotFoundError as exc:
        raise SnapshotInvalid("missing", f"{path.name} does not exist") from exc
    except OSError as exc:
        # ELOOP: O_NOFOLLOW met a symlink.
        reason = "is a symbolic link" if _NOFOLLOW and os.path.islink(path) else exc.strerror
        raise SnapshotInvalid("missing", f"{path.name} cannot be read: {reason}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SnapshotInvalid("missing", f"{path.name} is not a regular file")
        if _NONBLOCK and hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # a regular file; reads below are ordinary
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
