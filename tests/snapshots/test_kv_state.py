"""The cache protocol round trip: live slot -> state/metadata -> snapshot -> file -> live slot."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.snapshots import KVLayout, KVSnapshot, SlotCache, SnapshotInvalid
from strata.engine.core.snapshots import format as fmt

FINGERPRINT = "f" * 32


def filled_cache(num_tokens: int, dtype=torch.float32, max_tokens: int = 64) -> SlotCache:
    kv = KVCache(3, 2, 8, max_tokens, dtype)
    generator = torch.Generator().manual_seed(num_tokens)
    for layer in range(3):
        kv.k[layer].copy_(torch.randn(kv.k[layer].shape, generator=generator))
        kv.v[layer].copy_(torch.randn(kv.v[layer].shape, generator=generator))
    return SlotCache(kv, FINGERPRINT, list(range(100, 100 + num_tokens)))


def assert_same_used_rows(a: SlotCache, b: SlotCache) -> None:
    assert a.tokens == b.tokens and a.metadata == b.metadata
    for x, y in zip(a.state, b.state, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_round_trips_through_snapshot_and_file(tmp_path, dtype) -> None:
    cache = filled_cache(37, dtype)
    snapshot = KVSnapshot.capture(cache)
    # Only the used rows travel: [n, kv_heads, head_dim] per layer for k and v.
    assert [tuple(t.shape) for t in snapshot.state] == [(37, 2, 8)] * 6
    assert snapshot.nbytes == 37 * KVLayout.of(cache.kv).bytes_per_token
    path = tmp_path / "s.stkv"
    written = fmt.write_file(path, snapshot)
    assert written == path.stat().st_size
    read = fmt.read_file(path, FINGERPRINT, KVLayout.of(cache.kv), now_s=snapshot.created_s)
    restored = SlotCache.from_state(read.state, read.metadata, KVCache(3, 2, 8, 64, dtype))
    assert_same_used_rows(cache, restored)
    assert restored.nbytes == cache.nbytes


def test_from_state_of_a_snapshot_object_is_equal() -> None:
    snapshot = KVSnapshot.capture(filled_cache(5))
    again = KVSnapshot.from_state(snapshot.state, snapshot.metadata)
    assert again.metadata == snapshot.metadata
    assert all(torch.equal(a, b) for a, b in zip(again.state, snapshot.state, strict=True))


def test_capture_is_a_copy_not_a_view() -> None:
    cache = filled_cache(4)
    snapshot = KVSnapshot.capture(cache)
    cache.kv.k[0].zero_()
    assert snapshot.state[0].abs().sum() > 0


def test_from_state_refuses_another_layout_or_a_too_small_context() -> None:
    snapshot = KVSnapshot.capture(filled_cache(20))
    with pytest.raises(SnapshotInvalid) as wrong_heads:
        SlotCache.from_state(snapshot.state, snapshot.metadata, KVCache(3, 4, 8, 64))
    assert wrong_heads.value.reason == "other_layout"
    with pytest.raises(SnapshotInvalid, match="context is 10") as too_long:
        SlotCache.from_state(snapshot.state, snapshot.metadata, KVCache(3, 2, 8, 10))
    assert too_long.value.reason == "other_layout"
