"""A snapshot write that fails for lack of space or a read-only disk names a storage code, so the
host answers 507/500 instead of a 400 the client cannot fix (issue 17 item 11)."""

from __future__ import annotations

import pytest
import torch

from strata.engine import protocol as p
from strata.engine.core.error_codes import error_code
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.snapshots import KVSnapshot, SlotCache, SnapshotWriteError
from strata.engine.core.snapshots import format as fmt
from tests.helpers.tmpfs import fill, remount_read_only, small_tmpfs


def _snapshot() -> KVSnapshot:
    kv = KVCache(2, 2, 4, 32)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape))
    return KVSnapshot.capture(SlotCache(kv, "a" * 32, list(range(10))))


def _write_error(target) -> SnapshotWriteError:
    with pytest.raises(SnapshotWriteError) as caught:
        fmt.write_file(target, _snapshot())
    return caught.value


def test_disk_full_and_read_only_have_their_own_codes(tmp_path):
    with small_tmpfs(tmp_path / "disk") as disk:
        fill(disk)
        full = _write_error(disk / "slot.stkv")
        assert error_code(full, p.SaveSlot(0, "slot.stkv")) == "insufficient_storage"
        remount_read_only(disk)
        read_only = _write_error(disk / "slot.stkv")
        assert error_code(read_only, p.SaveSlot(0, "slot.stkv")) == "read_only_storage"


def test_other_write_failures_are_the_servers_too(tmp_path):
    # File names are checked before any write (plain names in the snapshot directory), so an
    # OS error while writing is the snapshot directory's state: a server fault, a 500.
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    refused = _write_error(blocker / "s.stkv")  # ENOTDIR
    assert error_code(refused, p.SaveSlot(0, "s.stkv")) == "storage_error"
