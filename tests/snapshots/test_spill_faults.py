"""Disk full in the middle of an offload: every slot is tried, the failed ones are named and
keep their memory, and the error is a server-side storage code (issue 17 items 11 and 14)."""

from __future__ import annotations

import errno
import shutil
import subprocess

import pytest

from strata.engine import protocol as p
from strata.engine.api.errors import from_error_event
from strata.engine.core.error_codes import error_code
from strata.engine.core.snapshots import SnapshotWriteError
from strata.engine.core.snapshots import format as fmt
from strata.engine.service.error_codes import level_error
from tests.snapshots.helpers import VOCAB, locations, make_engine, run

NUM_TOKENS = 357  # one slot's snapshot is about 185 KB: a 300 KiB disk holds one


def prompt(slot: int) -> list[int]:
    return [(i * 7 + slot) % (VOCAB - 20) for i in range(NUM_TOKENS)]


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 300 KiB tmpfs (real ENOSPC) where mounting is allowed; else the real writer, made to
    fail with ENOSPC from its second snapshot on."""
    directory = tmp_path / "small_fs"
    directory.mkdir(mode=0o700)
    mounted = shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=300k,mode=0700", "tmpfs", str(directory)],
        capture_output=True, check=False,
    ).returncode == 0
    if not mounted:
        real_write_to, calls = fmt.write_to, []

        def write_to(f, snapshot, slot=None):
            calls.append(slot)
            if len(calls) > 1:
                f.write(b"\0" * 4096)  # part of it lands, as on a filling disk
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write_to(f, snapshot, slot)

        monkeypatch.setattr(fmt, "write_to", write_to)
    yield directory
    if mounted:
        subprocess.run(["umount", "-l", str(directory)], check=False)


@pytest.mark.parametrize("persist", [False, True])
def test_disk_full_mid_offload_tries_every_slot_and_names_the_failed(
    model_dir, small_disk, persist
) -> None:
    engine = make_engine(model_dir, small_disk, snapshot_ram_budget_bytes=0,
                         persist_sessions=persist)
    answers = {slot: run(engine, prompt(slot), slot=slot) for slot in range(3)}
    with pytest.raises(SnapshotWriteError) as caught:
        engine.offload_session()
    error = caught.value
    assert error.code == "insufficient_storage"
    assert error.failed_slots == [1, 2]  # slot 0 (least recently used) went first and fit
    assert "slot(s) 1, 2" in str(error) and "No space left" in str(error)
    assert "\n" not in str(error)
    # Memory went back only for the slot whose write completed.
    assert locations(engine) == {0: "disk", 1: "cpu", 2: "cpu", 3: "empty"}
    status = {row["id"]: row["n_tokens"] for row in engine.slots_status()}
    assert status[1] == status[2] == NUM_TOKENS + len(answers[1]) - 1
    # Every history is still whole: each slot answers the same, from its cache.
    for slot in range(3):
        assert run(engine, prompt(slot), slot=slot) == answers[slot]
        assert engine.last_usage.cached_tokens == NUM_TOKENS - 1
    engine.close()


@pytest.mark.parametrize(("number", "code", "http_status"), [
    (errno.ENOSPC, "insufficient_storage", 507),
    (getattr(errno, "EDQUOT", errno.ENOSPC), "insufficient_storage", 507),
    (errno.EROFS, "read_only_storage", 500),
    (errno.EIO, "storage_error", 500),
])
def test_a_failed_write_is_a_server_side_error_code(number, code, http_status) -> None:
    exc = SnapshotWriteError.from_os_error("could not write KV snapshot a.bin",
                                           OSError(number, "os reason"))
    # The engine process answers with the code, the lifecycle and the HTTP layer map it.
    for command in (p.SaveSlot(0, "a.bin"), p.OffloadSession(), p.Sleep()):
        assert error_code(exc, command) == code
    answer = level_error("slot_save", code, str(exc))
    assert (answer.status, answer.code) == (http_status, code)
    assert from_error_event(p.Error(code, str(exc))).status == http_status
