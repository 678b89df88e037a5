"""SnapshotStore: RAM first within its budget, LRU spill to disk, disk budget, persistence."""

from __future__ import annotations

import os

import pytest
import torch

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.snapshots import (
    KVLayout,
    KVSnapshot,
    SlotCache,
    SnapshotInvalid,
    SnapshotNameError,
    SnapshotStore,
    SnapshotWriteError,
    check_filename,
)

FINGERPRINT = "c" * 32
LAYOUT = KVLayout(2, 2, 4, "float32")
TOKEN_BYTES = LAYOUT.bytes_per_token  # 128


def snap(num_tokens: int, first_token: int = 0) -> KVSnapshot:
    kv = KVCache(2, 2, 4, 256)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape))
    return KVSnapshot.capture(SlotCache(kv, FINGERPRINT, list(range(first_token, first_token + num_tokens))))


def store(tmp_path, ram_bytes=10_000, disk_bytes=1 << 20, **kwargs) -> SnapshotStore:
    return SnapshotStore(ram_bytes, tmp_path, disk_bytes, fingerprint=FINGERPRINT, layout=LAYOUT,
                         **kwargs)


def test_ram_first_then_lru_spill_to_disk(tmp_path) -> None:
    s = store(tmp_path, ram_bytes=100 * TOKEN_BYTES)
    assert s.put(0, snap(40)) == "ram"
    assert s.put(1, snap(40)) == "ram"
    s.put(2, snap(40))  # over the RAM budget: the oldest (slot 0) moves to disk
    assert [s.info(k)["location"] for k in (0, 1, 2)] == ["disk", "ram", "ram"]
    assert s.ram_bytes == 80 * TOKEN_BYTES
    # Not persistent: the disk copy is an anonymous temp file, nothing named in the directory.
    assert os.listdir(tmp_path) == []
    back = s.take(0)
    assert back.token_ids == tuple(range(40)) and s.info(0) is None


def test_a_snapshot_bigger_than_ram_goes_straight_to_disk(tmp_path) -> None:
    s = store(tmp_path, ram_bytes=0)
    original = snap(30)
    assert s.put(3, original) == "disk"
    back = s.take(3)
    assert all(torch.equal(a, b) for a, b in zip(back.state, original.state, strict=True))


def test_the_disk_budget_drops_the_oldest_disk_snapshot(tmp_path) -> None:
    s = store(tmp_path, ram_bytes=0, disk_bytes=70 * TOKEN_BYTES)
    s.put(0, snap(30))
    s.put(1, snap(30))
    assert s.info(0) is None and s.info(1)["location"] == "disk"


def test_a_kept_session_file_counts_against_the_disk_budget_and_goes_first(tmp_path) -> None:
    s = store(tmp_path, ram_bytes=0, disk_bytes=70 * TOKEN_BYTES, persist=True)
    s.put(0, snap(30))
    assert s.take(0).num_tokens == 30  # slot 0 is resident again; its file is kept
    kept_bytes = s.disk_bytes
    assert kept_bytes > 30 * TOKEN_BYTES and s.info(0) is None
    s.put(1, snap(30))  # both files do not fit: the kept copy goes, not slot 1's only one
    assert os.listdir(tmp_path) == [f"slot1-{FINGERPRINT}.stkv"]
    assert s.info(1)["location"] == "disk" and s.disk_bytes == s.info(1)["bytes"]


def test_too_big_for_the_disk_budget_is_a_write_error_and_stores_nothing(tmp_path) -> None:
    s = store(tmp_path, ram_bytes=0, disk_bytes=10 * TOKEN_BYTES)
    with pytest.raises(SnapshotWriteError, match="snapshot-disk-budget"):
        s.put(0, snap(30))
    assert s.info(0) is None and s.last_error


def test_an_os_error_while_spilling_keeps_the_older_snapshot_in_ram(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    s = store(blocker, ram_bytes=50 * TOKEN_BYTES)  # the "directory" is a file: writes fail
    s.put(0, snap(40))
    with pytest.raises(SnapshotWriteError, match="could not write"):
        s.put(1, snap(40, first_token=5))
    assert s.info(0)["location"] == "ram" and s.info(1) is None
    assert s.take(0).token_ids == tuple(range(40))


def test_ttl_expires_snapshots_in_ram(tmp_path) -> None:
    now = [1000.0]
    s = store(tmp_path, ttl_s=60, clock=lambda: now[0])
    created, expires = s.expiry_for_new()
    assert (created, expires) == (1000.0, 1060.0)
    kv = KVCache(2, 2, 4, 16)
    s.put(0, KVSnapshot.capture(SlotCache(kv, FINGERPRINT, [1, 2]), created, expires))
    now[0] = 1061.0
    with pytest.raises(SnapshotInvalid) as caught:
        s.take(0)
    assert caught.value.reason == "expired" and s.info(0) is None


def test_persistent_files_are_found_again_by_slot_and_fingerprint(tmp_path) -> None:
    first = store(tmp_path, persist=True)
    first.put(2, snap(12))
    first.close()  # RAM snapshots of a persistent store are written out at close
    assert os.listdir(tmp_path) == [f"slot2-{FINGERPRINT}.stkv"]
    other_model = SnapshotStore(10_000, tmp_path, 1 << 20, persist=True, fingerprint="d" * 32,
                                layout=LAYOUT)
    assert other_model.info(2) is None
    again = store(tmp_path, persist=True)
    assert again.info(2) == {"location": "disk", "n_tokens": 12,
                             "bytes": (tmp_path / f"slot2-{FINGERPRINT}.stkv").stat().st_size}
    assert again.take(2).token_ids == tuple(range(12))
    # Taken back into a slot, the file stays until a newer snapshot replaces it (a crash
    # before then loses nothing); a third engine finds it again.
    assert os.listdir(tmp_path) == [f"slot2-{FINGERPRINT}.stkv"]
    assert store(tmp_path, persist=True).info(2)["n_tokens"] == 12
    again.put(2, snap(20))
    again.close()
    third = store(tmp_path, persist=True)
    assert third.take(2).token_ids == tuple(range(20))  # the newer snapshot replaced it
    third.drop(2)  # erasing the slot deletes the file it kept
    assert os.listdir(tmp_path) == []


def test_a_non_persistent_store_leaves_nothing_after_close(tmp_path) -> None:
    s = store(tmp_path, ram_bytes=0)
    s.put(0, snap(10))
    s.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "name", ["", "../x", "a/b", "a\\b", "/etc/passwd", "C:\\x", "c:x", "..", "a\0b", "x" * 256]
)
def test_unsafe_file_names_are_refused(name) -> None:
    with pytest.raises(SnapshotNameError) as caught:
        check_filename(name)
    assert "\n" not in str(caught.value)


def test_plain_names_are_accepted(tmp_path) -> None:
    s = store(tmp_path)
    assert s.save_named("chat-1.bin", snap(5)) == (tmp_path / "chat-1.bin").stat().st_size
    back, read_bytes = s.load_named("chat-1.bin")
    assert back.num_tokens == 5 and read_bytes == (tmp_path / "chat-1.bin").stat().st_size
