"""Snapshots that go wrong: each bad one is dropped and answered cold; nothing else is lost."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from strata.engine.core.snapshots import SnapshotWriteError
from tests.snapshots.helpers import SLOT_KV_BYTES, Conversation, locations, make_engine, run


def persist_two_chats(model_dir, snapshot_dir, cold, expire_slot0: bool = False):
    """An engine holds two chats, persists them and exits; returns the chats and answers."""
    engine = make_engine(model_dir, snapshot_dir, persist_sessions=True, snapshot_ttl_s=3600)
    chats = [Conversation(0, 21, 300), Conversation(1, 22, 300)]
    answers = [chat.turn(engine, cold, None) for chat in chats]
    if expire_slot0:
        # The same store, its clock two hours back: slot 0's snapshot is stale on arrival.
        engine.slots.store.clock = lambda: time.time() - 7200
        engine.slots.offload(0)
        engine.slots.store.clock = time.time
    engine.offload_session()
    engine.close()
    return chats, answers


def slot_file(snapshot_dir, slot: int):
    (path,) = snapshot_dir.glob(f"slot{slot}-*.stkv")
    return path


def truncate(path, _other) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path, _other) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 2 // 3] ^= 0x01
    path.write_bytes(bytes(data))


def delete(path, _other) -> None:
    path.unlink()


def swap_in_another_models(path, other) -> None:
    shutil.copyfile(other, path)


FAULTS = {
    "truncate": (truncate, "truncated"),
    "flip": (flip_a_byte, "corrupt"),
    "delete": (delete, "missing"),
    "swap": (swap_in_another_models, "other_model"),
    "expire": (None, "expired"),
}


@pytest.fixture(scope="module")
def other_models_snapshot(other_model_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("other_snapshots")
    engine = make_engine(other_model_dir, directory, persist_sessions=True)
    run(engine, list(range(5, 305)), slot=0)
    engine.close()
    return slot_file(directory, 0)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_bad_snapshot_is_dropped_and_answered_cold(
    fault, model_dir, cold, tmp_path, other_models_snapshot
) -> None:
    damage, reason = FAULTS[fault]
    chats, answers = persist_two_chats(model_dir, tmp_path, cold, expire_slot0=fault == "expire")
    engine = make_engine(model_dir, tmp_path, persist_sessions=True, snapshot_ttl_s=3600)
    assert locations(engine) == {0: "disk", 1: "disk", 2: "empty", 3: "empty"}
    if damage is not None:
        damage(slot_file(tmp_path, 0), other_models_snapshot)
    chats[0].num_computed = 0  # the history is cleared: the whole prompt is prefilled again
    chats[0].turn(engine, cold, answers[0])
    assert engine.slots.last_restore["dropped"] == reason
    # Nothing else is lost: slot 1 comes back whole.
    chats[1].turn(engine, cold, answers[1])
    assert engine.slots.last_restore["source"] == "disk"
    assert engine.slots.last_restore["dropped"] is None


@pytest.fixture
def unwritable_dir(tmp_path):
    """A 64 KiB tmpfs (real ENOSPC) where mounting is allowed, else a path under a plain file."""
    directory = tmp_path / "tiny_fs"
    directory.mkdir()
    mounted = shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(directory)],
        capture_output=True, check=False,
    ).returncode == 0
    if not mounted:
        blocker = tmp_path / "a_file"
        blocker.write_text("a file where the snapshot directory should be")
        directory = blocker / "snapshots"  # every create fails with ENOTDIR
    yield directory, mounted
    if mounted:
        subprocess.run(["umount", str(directory)], check=False)


def test_a_failed_write_keeps_the_memory_and_reports_the_error(model_dir, cold, unwritable_dir) -> None:
    snapshot_dir, is_tmpfs = unwritable_dir
    engine = make_engine(model_dir, snapshot_dir, snapshot_ram_budget_bytes=0,
                         kv_budget_bytes=SLOT_KV_BYTES)
    chat = Conversation(0, 31, 400)  # 200 KiB of KV: more than the 64 KiB tmpfs holds
    answer = chat.turn(engine, cold, None)
    with pytest.raises(SnapshotWriteError, match="could not write a KV snapshot") as caught:
        engine.offload_session()
    assert "\n" not in str(caught.value)
    assert engine.slots_status()[0]["location"] == "cpu"
    assert engine.slots_status()[0]["n_tokens"] == chat.num_computed
    # Switching slots needs an eviction that fails the same way: slot 0 stays, over budget.
    other = Conversation(1, 32, 100)
    other.turn(engine, cold, None)
    assert locations(engine)[0] == "cpu" and "could not write" in engine.slots.last_error
    chat.turn(engine, cold, answer)  # all of slot 0's history is still there
    if is_tmpfs:
        assert os.listdir(snapshot_dir) == []  # no half-written file left behind
