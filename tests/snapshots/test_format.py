"""The snapshot file: every way it can be wrong is caught and named by one reason."""

from __future__ import annotations

import os
import time

import pytest
import torch

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.snapshots import (
    KVLayout,
    KVSnapshot,
    SlotCache,
    SnapshotInvalid,
    SnapshotWriteError,
)
from strata.engine.core.snapshots import format as fmt

FINGERPRINT = "a" * 32
LAYOUT = KVLayout(2, 2, 4, "float32")


def snapshot(num_tokens: int = 10, expires_s: float | None = None) -> KVSnapshot:
    kv = KVCache(2, 2, 4, 32)
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape))
    return KVSnapshot.capture(SlotCache(kv, FINGERPRINT, list(range(num_tokens))),
                              expires_s=expires_s)


@pytest.fixture
def path(tmp_path):
    target = tmp_path / "slot.stkv"
    fmt.write_file(target, snapshot())
    return target


def reason_of(path, fingerprint=FINGERPRINT, layout=LAYOUT, now_s=None) -> str:
    with pytest.raises(SnapshotInvalid) as caught:
        fmt.read_file(path, fingerprint, layout, now_s or time.time())
    assert "\n" not in str(caught.value)
    return caught.value.reason


def flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_good_file_reads_back(path) -> None:
    read = fmt.read_file(path, FINGERPRINT, LAYOUT, time.time())
    assert read.token_ids == tuple(range(10))


def test_missing(tmp_path) -> None:
    assert reason_of(tmp_path / "nope.stkv") == "missing"


@pytest.mark.parametrize("keep", [0, 5, 20, -1, -100])
def test_truncated(path, keep) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    assert reason_of(path) == "truncated"


def test_trailing_bytes_are_corrupt(path) -> None:
    path.write_bytes(path.read_bytes() + b"x")
    assert reason_of(path) == "corrupt"


@pytest.mark.parametrize("where", ["magic", "header", "tokens", "first_region", "last_byte"])
def test_a_flipped_byte_is_corrupt(path, where) -> None:
    size = path.stat().st_size
    payload_bytes = 10 * 4 + 4 * 10 * LAYOUT.region_bytes_per_token
    payload_start = size - payload_bytes
    offset = {"magic": 0, "header": 30, "tokens": payload_start + 1,
              "first_region": payload_start + 40 + 3, "last_byte": size - 1}[where]
    flip(path, offset)
    assert reason_of(path) == "corrupt"


def test_other_version(path) -> None:
    data = bytearray(path.read_bytes())
    data[8] = 99  # the little-endian version number follows the 8-byte magic
    path.write_bytes(bytes(data))
    assert reason_of(path) == "other_version"


def test_other_model_and_other_layout(path) -> None:
    assert reason_of(path, fingerprint="b" * 32) == "other_model"
    assert reason_of(path, layout=KVLayout(2, 2, 4, "bfloat16")) == "other_layout"
    assert reason_of(path, layout=KVLayout(3, 2, 4, "float32")) == "other_layout"


def test_expired(tmp_path) -> None:
    target = tmp_path / "old.stkv"
    fmt.write_file(target, snapshot(expires_s=1000.0))
    assert reason_of(target, now_s=1001.0) == "expired"
    assert fmt.read_file(target, FINGERPRINT, LAYOUT, now_s=999.0).num_tokens == 10


def test_write_is_atomic_and_leaves_no_temp_file(tmp_path) -> None:
    target = tmp_path / "s.stkv"
    fmt.write_file(target, snapshot(10))
    fmt.write_file(target, snapshot(12))  # replaces the old file in one rename
    assert sorted(os.listdir(tmp_path)) == ["s.stkv"]
    assert fmt.read_file(target, FINGERPRINT, LAYOUT, time.time()).num_tokens == 12


def test_a_failed_write_raises_one_line_and_leaves_the_old_file(tmp_path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(SnapshotWriteError, match="could not write KV snapshot") as caught:
        fmt.write_file(blocker / "s.stkv", snapshot())
    assert "\n" not in str(caught.value)
    assert blocker.read_text() == "not a directory"
