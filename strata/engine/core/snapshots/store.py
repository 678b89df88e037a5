"""Where slot snapshots wait: host RAM first, then files in the snapshot directory.

RAM holds up to `ram_budget_bytes`; past it the least recently stored RAM snapshot is written
to disk. Disk holds up to `disk_budget_bytes`; past it the oldest disk snapshot is deleted (its
slot starts over). Without `persist`, disk snapshots are anonymous temporary files that the OS
deletes when they are closed or the process dies; with it they are named files
`slot{N}-{fingerprint}.stkv` that a restarted engine of the same model finds again. A
persisted file stays on disk after its slot is restored, until a newer snapshot of that slot
replaces it or the slot is erased, so an engine that crashes or is OOM-killed loses nothing.
Files are 0600 in a 0700 directory (safe_files.py).

A `put` that cannot store its snapshot raises SnapshotWriteError and stores nothing, so the
caller still holds the KV it meant to release: memory is released only after a write completed.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from strata.engine.core.snapshots import format as fmt
from strata.engine.core.snapshots.errors import (
    NO_SPACE_CODE,
    SnapshotInvalid,
    SnapshotNameError,
    SnapshotWriteError,
)
from strata.engine.core.snapshots.host_pool import HostPool
from strata.engine.core.snapshots.kv_state import KVLayout, KVSnapshot
from strata.engine.core.snapshots.safe_files import prepare_dir
from strata.engine.protocol import filename_problem

log = logging.getLogger(__name__)

RAM, DISK = "ram", "disk"
_MIB = 1 << 20


@dataclass
class _Entry:
    key: int
    location: str  # ram | disk
    num_tokens: int
    nbytes: int  # what it occupies where it is: payload bytes in RAM, file bytes on disk
    order: int  # larger = stored more recently
    snapshot: KVSnapshot | None = None  # in RAM
    file: BinaryIO | None = None  # anonymous temporary file (not persisted)
    path: Path | None = None  # named file (persisted)


def check_filename(filename: object) -> str:
    """A plain file name for an explicit slot save (protocol.filename_problem, the one check);
    raises SnapshotNameError otherwise."""
    problem = filename_problem(filename)
    if problem is None:
        return str(filename)
    if not isinstance(filename, str) or not filename.strip():
        raise SnapshotNameError("the slot file name is empty: pass a plain name such as 'chat1.bin'")
    raise SnapshotNameError(f"{problem}: slots are saved inside the snapshot directory")


class SnapshotStore:
    """Slot snapshots of one model, keyed by slot id, in RAM then on disk, within byte budgets."""

    def __init__(
        self,
        ram_budget_bytes: int,
        disk_dir: str | os.PathLike[str],
        disk_budget_bytes: int,
        persist: bool = False,
        ttl_s: float = 0.0,
        *,
        fingerprint: str,
        layout: KVLayout,
        clock: Callable[[], float] = time.time,
        is_default_dir: bool = False,
    ):
        """is_default_dir: disk_dir is Strata's own default, whose mode may be tightened to
        0700; a directory the user named is checked, never changed."""
        for name, value in (("ram_budget_bytes", ram_budget_bytes),
                            ("disk_budget_bytes", disk_budget_bytes), ("ttl_s", ttl_s)):
            if value < 0:
                raise ValueError(f"SnapshotStore {name} must be >= 0, not {value}")
        self.ram_budget_bytes = ram_budget_bytes
        self.disk_dir = Path(disk_dir)
        self.disk_budget_bytes = disk_budget_bytes
        self.is_persistent = persist
        self.ttl_s = ttl_s  # 0: snapshots never expire
        self.fingerprint = fingerprint
        self.layout = layout
        self.clock = clock
        self.last_error: str | None = None
        self.is_default_dir = is_default_dir
        self._entries: dict[int, _Entry] = {}
        # Persisted files of slots that were restored: (path, bytes), kept until replaced or
        # erased; they count against the disk budget and are the first to go when it is full.
        self._kept_paths: dict[int, tuple[Path, int]] = {}
        self._order = itertools.count()
        # RAM snapshots captured for this model land in pinned blocks of this pool; its
        # capacity is the RAM budget, and a block returns when its snapshot is dropped.
        self.host_pool = HostPool(ram_budget_bytes, name=f"snapshot pool of {fingerprint[:8]}")
        if persist:
            self._adopt_persisted()

    # ---- queries ---------------------------------------------------------------------------

    def expiry_for_new(self) -> tuple[float, float | None]:
        """(created_s, expires_s) for a snapshot taken now."""
        now_s = self.clock()
        return now_s, (now_s + self.ttl_s if self.ttl_s > 0 else None)

    def stored_tokens(self, key: int) -> tuple[int, ...] | None:
        """The token ids of a snapshot kept in a named file (a persisted session of an
        earlier engine), read without its KV; None otherwise."""
        entry = self._entries.get(key)
        if entry is None or entry.path is None:
            return None
        return fmt.peek_tokens(entry.path)

    def info(self, key: int) -> dict | None:
        """{"location", "n_tokens", "bytes"} of the snapshot stored for `key`, or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        return {"location": entry.location, "n_tokens": entry.num_tokens, "bytes": entry.nbytes}

    @property
    def ram_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.location == RAM)

    @property
    def disk_bytes(self) -> int:
        """Bytes of snapshot files on disk, the kept files of restored slots included."""
        kept_bytes = sum(nbytes for _, nbytes in self._kept_paths.values())
        return sum(e.nbytes for e in self._entries.values() if e.location == DISK) + kept_bytes

    # ---- storing and taking ----------------------------------------------------------------

    def put(self, key: int, snapshot: KVSnapshot) -> str:
        """Store `snapshot` for `key`, replacing any; returns where it went (ram or disk).

        Raises SnapshotWriteError when it could not be stored; nothing is stored for `key` then.
        """
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._discard(entry)
        entry = _Entry(key, RAM, snapshot.num_tokens, snapshot.nbytes, next(self._order),
                       snapshot=snapshot)
        try:
            if not self.make_room(snapshot.nbytes):
                self._spill(entry)
        except SnapshotWriteError as exc:
            self.last_error = str(exc)
            raise
        self._entries[key] = entry
        return entry.location

    def make_room(self, nbytes: int) -> bool:
        """Make RAM room for a snapshot of nbytes (older RAM snapshots move to disk); False
        when it is larger than the whole RAM budget and will go to disk itself.

        After True, a put of that size cannot fail, which lets a caller give the KV back while
        the copy is still running. Raises SnapshotWriteError when a spill fails (nothing of
        the new snapshot is stored yet then)."""
        if nbytes > self.ram_budget_bytes:
            return False
        try:
            while self.ram_bytes + nbytes > self.ram_budget_bytes:
                self._spill(min((e for e in self._entries.values() if e.location == RAM),
                                key=lambda e: e.order))
        except SnapshotWriteError as exc:
            self.last_error = str(exc)
            raise
        return True

    def take(self, key: int) -> KVSnapshot | None:
        """Remove and return the snapshot of `key` (None when there is none).

        Raises SnapshotInvalid when it fails verification; it is gone from the store either way.
        """
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        try:
            now_s = self.clock()
            if entry.location == RAM:
                if entry.snapshot.is_expired(now_s):
                    raise SnapshotInvalid("expired", "its time to live ran out in RAM")
                return entry.snapshot
            if entry.file is not None:
                return fmt.read_from(entry.file, self.fingerprint, self.layout, now_s)
            snapshot = fmt.read_file(entry.path, self.fingerprint, self.layout, now_s)
            # The file outlives the restore: a crash before the next snapshot loses nothing.
            self._kept_paths[key], entry.path = (entry.path, entry.nbytes), None
            return snapshot
        finally:
            self._discard(entry)

    def drop(self, key: int) -> None:
        """Forget the snapshot of `key`, freeing its RAM or deleting its file (also the file
        a restored persistent slot kept)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._discard(entry)
        kept = self._kept_paths.pop(key, None)
        if kept is not None:
            self._unlink(kept[0])

    def _spill(self, entry: _Entry) -> None:
        """Move a RAM entry to disk; on failure it stays in RAM and SnapshotWriteError is raised."""
        snapshot = entry.snapshot
        estimate_bytes = snapshot.nbytes + 4 * snapshot.num_tokens
        if estimate_bytes > self.disk_budget_bytes:
            raise SnapshotWriteError(
                f"a KV snapshot of {estimate_bytes / _MIB:.1f} MiB does not fit the snapshot disk "
                f"budget of {self.disk_budget_bytes / _MIB:.1f} MiB; raise --snapshot-disk-budget",
                NO_SPACE_CODE,
            )
        self._evict_disk(self.disk_budget_bytes - estimate_bytes, keep=entry)
        self.prepare_dir()
        try:
            if self.is_persistent:
                path = self.disk_dir / self._session_name(entry.key)
                written = fmt.write_file(path, snapshot, slot=entry.key)
                entry.path = path
                self._kept_paths.pop(entry.key, None)  # the same name: replaced just now
            else:
                entry.file, written = self._write_anonymous(snapshot, entry.key)
        except OSError as exc:  # a raw errno from anywhere in the write is still a write error
            raise SnapshotWriteError.from_os_error(
                f"could not write slot {entry.key}'s KV snapshot", exc) from exc
        entry.location, entry.nbytes, entry.snapshot = DISK, written, None
        self._evict_disk(self.disk_budget_bytes, keep=entry)

    def _write_anonymous(self, snapshot: KVSnapshot, key: int) -> tuple[BinaryIO, int]:
        f = None
        try:
            # Delete-on-close: on Linux an O_TMPFILE with no name, so even a crash leaves nothing.
            f = tempfile.TemporaryFile(dir=self.disk_dir, prefix="strata-kv-")  # noqa: SIM115 - kept open on purpose
            return f, fmt.write_to(f, snapshot, slot=key)
        except OSError as exc:
            if f is not None:
                f.close()
            raise SnapshotWriteError.from_os_error(
                f"could not write a KV snapshot into {self.disk_dir.name}", exc) from exc

    def prepare_dir(self) -> None:
        """Create the snapshot directory 0700 and refuse it when others could write there;
        raises SnapshotWriteError (storage_error)."""
        prepare_dir(self.disk_dir, is_strata_own=self.is_default_dir)

    def _evict_disk(self, limit_bytes: int, keep: _Entry) -> None:
        """Delete the oldest disk snapshots (not `keep`) until disk use is within limit_bytes."""
        while True:
            victims = [e for e in self._entries.values() if e.location == DISK and e is not keep]
            # A kept file of keep's own slot is about to be replaced: not counted.
            kept = [k for k in self._kept_paths if k != keep.key]
            # `keep` may not be registered yet (a put in progress): count it once either way.
            used_bytes = (sum(e.nbytes for e in victims) + (keep.nbytes if keep.location == DISK else 0)
                          + sum(self._kept_paths[k][1] for k in kept))
            if used_bytes <= limit_bytes:
                return
            if kept:  # its slot is resident: only the copy that survives a crash goes
                log.info("snapshot disk budget full: deleting slot %d's kept session file", kept[0])
                self._unlink(self._kept_paths.pop(kept[0])[0])
                continue
            if not victims:
                return
            victim = min(victims, key=lambda e: e.order)
            log.info("snapshot disk budget full: dropping slot %d's snapshot", victim.key)
            self.drop(victim.key)

    def _discard(self, entry: _Entry) -> None:
        entry.snapshot = None
        if entry.file is not None:
            entry.file.close()
            entry.file = None
        if entry.path is not None:
            self._unlink(entry.path)
            entry.path = None

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not delete snapshot %s: %s", path, exc)

    # ---- persisted session files -----------------------------------------------------------

    def _session_name(self, key: int) -> str:
        return f"slot{key}-{self.fingerprint}.stkv"

    def _adopt_persisted(self) -> None:
        """Register the session files a previous engine of this model left behind."""
        pattern = re.compile(rf"slot(\d+)-{re.escape(self.fingerprint)}\.stkv")
        if not self.disk_dir.is_dir():
            return  # no directory yet: nothing was persisted
        try:
            self.prepare_dir()
        except SnapshotWriteError as exc:
            log.warning("persisted sessions not read: %s", exc)
            return
        try:
            paths = sorted(self.disk_dir.iterdir(), key=lambda p: p.stat().st_mtime)
        except OSError:
            return  # no directory yet: nothing was persisted
        for path in paths:
            match = pattern.fullmatch(path.name)
            if match is None:
                continue
            header = fmt.peek_header(path) or {}
            key = int(match.group(1))
            # Verification happens on take(); an unreadable header only hides the token count.
            self._entries[key] = _Entry(key, DISK, int(header.get("num_tokens") or 0),
                                        path.stat().st_size, next(self._order), path=path)

    # ---- explicit saves --------------------------------------------------------------------

    def named_path(self, filename: str) -> Path:
        """The path of an explicitly saved slot file; raises SnapshotNameError for unsafe names."""
        return self.disk_dir / check_filename(filename)

    def save_named(self, filename: str, snapshot: KVSnapshot) -> int:
        """Write `snapshot` to `filename` in the snapshot directory; returns bytes written."""
        path = self.named_path(filename)
        self.prepare_dir()
        return fmt.write_file(path, snapshot)

    def load_named(self, filename: str) -> tuple[KVSnapshot, int]:
        """Read and verify `filename` from the snapshot directory; (snapshot, bytes read)."""
        path = self.named_path(filename)
        self.prepare_dir()
        snapshot = fmt.read_file(path, self.fingerprint, self.layout, self.clock())
        return snapshot, path.stat().st_size

    # ---- lifetime --------------------------------------------------------------------------

    def close(self, free_host_memory: bool = True) -> None:
        """Persistent: write RAM snapshots to their files. Otherwise: free RAM, delete files.
        free_host_memory=False leaves the pinned pool to the process exit (the CUDA context
        may already be gone, and unregistering needs it)."""
        for entry in sorted(self._entries.values(), key=lambda e: e.order):
            if self.is_persistent and entry.location == RAM:
                try:
                    self._spill(entry)
                    continue
                except SnapshotWriteError as exc:
                    log.warning("slot %d's snapshot is lost at close: %s", entry.key, exc)
            if not self.is_persistent:
                self._discard(entry)
            entry.snapshot = None  # its pool block returns once no one else holds it
        self._entries.clear()
        if free_host_memory:
            self.host_pool.close()
