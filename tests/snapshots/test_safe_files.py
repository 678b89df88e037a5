"""Snapshot files are private and cannot be redirected: issue 17 items 2, 3 and 5 (FIFO)."""

from __future__ import annotations

import errno
import os
import stat
import threading
import time

import pytest

from strata.engine.core.snapshots import SnapshotInvalid, SnapshotWriteError
from strata.engine.core.snapshots import format as fmt
from tests.snapshots.test_store import FINGERPRINT, LAYOUT, snap, store

posix_only = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@posix_only
def test_a_symlink_at_the_old_temp_name_does_not_redirect_a_save(tmp_path) -> None:
    directory = tmp_path / "snapshots"
    directory.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    # The name a save used to write through (the engine pid is in /v1/status).
    (directory / f".chat.bin.{os.getpid()}.tmp").symlink_to(victim)
    (directory / "other.bin").symlink_to(victim)  # the final name planted too
    s = store(directory)
    s.save_named("chat.bin", snap(10))
    s.save_named("other.bin", snap(5))
    assert victim.read_text() == "precious"
    assert not (directory / "other.bin").is_symlink()  # replaced by a file, not written through
    assert s.load_named("chat.bin")[0].token_ids == tuple(range(10))
    leftovers = {p.name for p in directory.iterdir()} - {"chat.bin", "other.bin"}
    assert leftovers == {f".chat.bin.{os.getpid()}.tmp"}  # only the planted link: no temp left


@posix_only
def test_snapshot_files_are_0600_in_a_0700_directory(tmp_path) -> None:
    directory = tmp_path / "new" / "snapshots"
    s = store(directory, ram_bytes=0, persist=True)
    s.save_named("chat.bin", snap(10))
    s.put(1, snap(12))  # RAM budget 0: straight to its session file
    assert mode_of(directory) == 0o700
    assert {p.name: mode_of(p) for p in directory.iterdir()} == {
        "chat.bin": 0o600, f"slot1-{FINGERPRINT}.stkv": 0o600}


@posix_only
def test_stratas_own_directory_is_tightened_a_named_one_is_not(tmp_path) -> None:
    own, named = tmp_path / "own", tmp_path / "named"
    own.mkdir(mode=0o755)
    named.mkdir(mode=0o755)
    os.chmod(own, 0o755)
    os.chmod(named, 0o755)
    store(own, is_default_dir=True).save_named("a.bin", snap(3))
    store(named).save_named("a.bin", snap(3))
    assert mode_of(own) == 0o700
    assert mode_of(named) == 0o755  # the user's choice; its files are still 0600
    assert mode_of(named / "a.bin") == 0o600


@posix_only
@pytest.mark.parametrize("is_default_dir", [False, True])
def test_a_directory_others_can_write_is_refused(tmp_path, is_default_dir) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    os.chmod(directory, 0o777)
    s = store(directory, ram_bytes=0)
    if is_default_dir:  # Strata's own directory is tightened instead
        store(directory, is_default_dir=True).save_named("a.bin", snap(3))
        assert mode_of(directory) == 0o700
        return
    with pytest.raises(SnapshotWriteError, match="writable by other users") as caught:
        s.save_named("a.bin", snap(3))
    assert caught.value.code == "storage_error" and "\n" not in str(caught.value)
    with pytest.raises(SnapshotWriteError, match="writable by other users"):
        s.put(0, snap(3))  # a spill is refused the same way; nothing stored
    assert s.info(0) is None and os.listdir(directory) == []


@posix_only
@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_a_directory_of_another_user_is_refused(tmp_path) -> None:
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)  # nobody
    with pytest.raises(SnapshotWriteError, match="belongs to another user"):
        store(directory).save_named("a.bin", snap(3))
    assert os.listdir(directory) == []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
def test_a_fifo_named_like_a_slot_file_is_refused_without_blocking(tmp_path) -> None:
    directory = tmp_path / "snapshots"
    directory.mkdir(mode=0o700)
    os.mkfifo(directory / "x.slot")
    os.mkfifo(directory / f"slot0-{FINGERPRINT}.stkv")
    outcome: list = []

    def restore() -> None:
        try:
            s = store(directory, persist=True)  # adopting reads headers: must not block either
            outcome.append(s.load_named("x.slot"))
        except SnapshotInvalid as exc:
            outcome.append(exc)

    reader = threading.Thread(target=restore, daemon=True)
    started_s = time.monotonic()
    reader.start()
    reader.join(10)
    if reader.is_alive():  # blocked in open(): unblock it by opening the write ends
        for name in ("x.slot", f"slot0-{FINGERPRINT}.stkv"):
            try:
                os.close(os.open(directory / name, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as exc:
                assert exc.errno == errno.ENXIO
        reader.join(5)
        pytest.fail("restoring from a FIFO blocked")
    assert time.monotonic() - started_s < 10
    (exc,) = outcome
    assert isinstance(exc, SnapshotInvalid) and "not a regular file" in str(exc)


@posix_only
def test_a_symlinked_slot_file_is_not_followed_on_restore(tmp_path) -> None:
    directory = tmp_path / "snapshots"
    directory.mkdir(mode=0o700)
    real = tmp_path / "elsewhere.bin"
    fmt.write_file(real, snap(4))
    (directory / "link.bin").symlink_to(real)
    with pytest.raises(SnapshotInvalid, match="symbolic link"):
        store(directory).load_named("link.bin")
    assert fmt.read_file(real, FINGERPRINT, LAYOUT, time.time()).num_tokens == 4
