"""HostPool: first fit, coalescing, the capacity bound, free on drop; capture and restore through it."""

from __future__ import annotations

import gc
import logging
import time

import pytest
import torch

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.snapshots import KVLayout, KVSnapshot, SlotCache, SnapshotStore
from strata.engine.core.snapshots.host_pool import ALIGN_BYTES, HostPool
from tests.snapshots.helpers import locations, make_engine, run

KIB = 1 << 10
FINGERPRINT = "p" * 32


def filled_cache(num_tokens: int, dtype=torch.float32, device="cpu", max_tokens=64) -> SlotCache:
    kv = KVCache(3, 2, 8, max_tokens, dtype, device)
    generator = torch.Generator().manual_seed(num_tokens)
    for layer in range(3):
        kv.k[layer].copy_(torch.randn(kv.k[layer].shape, generator=generator))
        kv.v[layer].copy_(torch.randn(kv.v[layer].shape, generator=generator))
    return SlotCache(kv, FINGERPRINT, list(range(num_tokens)))


def test_a_freed_block_is_reused_at_the_same_address() -> None:
    pool = HostPool(1024 * KIB, segment_bytes=256 * KIB)
    a = pool.alloc(100 * KIB)
    b = pool.alloc(100 * KIB)
    a_address = a.data_ptr()
    assert pool.used_bytes == 200 * KIB and pool.num_segments == 1
    del a
    assert pool.used_bytes == 100 * KIB
    c = pool.alloc(60 * KIB)  # first fit: the hole a left, not the tail after b
    assert c.data_ptr() == a_address
    del b, c
    assert pool.used_bytes == 0 and pool.reserved_bytes == 256 * KIB  # kept for the next one


def test_sizes_round_up_to_the_alignment() -> None:
    pool = HostPool(64 * KIB, segment_bytes=64 * KIB)
    blocks = [pool.alloc(1) for _ in range(3)]
    assert [b.numel() for b in blocks] == [1, 1, 1]
    assert pool.used_bytes == 3 * ALIGN_BYTES
    assert all(b.data_ptr() % ALIGN_BYTES == 0 for b in blocks)
    with pytest.raises(ValueError, match="positive size"):
        pool.alloc(0)


def test_neighbouring_holes_coalesce_into_one_range() -> None:
    pool = HostPool(256 * KIB, segment_bytes=256 * KIB)
    blocks = [pool.alloc(64 * KIB) for _ in range(4)]
    second = blocks[1].data_ptr()
    assert pool.alloc(KIB) is None  # full: capacity reached, no second segment
    del blocks[2], blocks[1]  # free 3rd then 2nd: they merge into one 128 KiB hole
    merged = pool.alloc(128 * KIB)
    assert merged is not None and merged.data_ptr() == second
    del merged, blocks
    assert pool._segments[0].free == [(0, 256 * KIB)]


def test_growth_stops_at_the_capacity() -> None:
    pool = HostPool(600 * KIB, segment_bytes=256 * KIB)
    held = [pool.alloc(200 * KIB) for _ in range(2)]  # one per 256 KiB segment
    assert pool.num_segments == 2
    # 88 KiB remain of the capacity: the last segment is cut to fit it exactly.
    held.append(pool.alloc(80 * KIB))
    assert held[-1] is not None and pool.reserved_bytes == 600 * KIB
    assert pool.alloc(57 * KIB) is None  # free: two 56 KiB tails and 8 KiB, none holds it
    assert pool.alloc(56 * KIB) is not None  # a tail that fits exactly
    assert pool.alloc(700 * KIB) is None
    assert pool.reserved_bytes <= pool.capacity_bytes


def test_prepare_grows_a_segment_that_the_next_block_reuses() -> None:
    pool = HostPool(1024 * KIB, segment_bytes=128 * KIB)
    assert pool.prepare(300 * KIB) and pool.used_bytes == 0
    reserved = pool.reserved_bytes
    assert reserved >= 300 * KIB and pool.num_segments == 1
    block = pool.alloc(300 * KIB)
    assert pool.reserved_bytes == reserved and pool.num_segments == 1
    assert not pool.prepare(2048 * KIB) and block is not None


def test_idle_segments_give_way_to_a_bigger_block() -> None:
    pool = HostPool(512 * KIB, segment_bytes=128 * KIB)
    blocks = [pool.alloc(128 * KIB) for _ in range(4)]
    assert pool.num_segments == 4 and pool.alloc(KIB) is None
    del blocks
    big = pool.alloc(512 * KIB)  # fragmented over 4 idle segments: they are dropped for one
    assert big is not None and pool.num_segments == 1 and pool.reserved_bytes == 512 * KIB


def test_a_view_keeps_its_block_alive() -> None:
    pool = HostPool(64 * KIB, segment_bytes=64 * KIB)
    block = pool.alloc(32 * KIB)
    view = block[1024:2048].view(torch.float32)
    view.fill_(3.5)
    del block
    gc.collect()
    assert pool.used_bytes == 32 * KIB  # the view still reads these bytes: not reusable
    other = pool.alloc(32 * KIB)
    other.fill_(0)
    assert torch.all(view == 3.5)
    del view
    assert pool.used_bytes == 32 * KIB  # only `other` is left


def test_a_block_dropped_while_the_pool_is_busy_is_freed_later() -> None:
    pool = HostPool(64 * KIB, segment_bytes=64 * KIB)
    block = pool.alloc(64 * KIB)
    with pool._lock:  # as if the garbage collector ran a finalizer inside alloc
        del block
        assert len(pool._pending_frees) == 1
    assert pool.alloc(64 * KIB) is not None  # drained first, so the space is there


def test_a_closed_pool_hands_out_nothing_and_frees_segments_when_blocks_go() -> None:
    pool = HostPool(128 * KIB, segment_bytes=64 * KIB)
    kept = pool.alloc(10 * KIB)
    pool.alloc(60 * KIB)  # does not fit beside `kept`: a second segment, idle once dropped
    assert pool.num_segments == 2
    pool.close()
    assert pool.num_segments == 1 and pool.alloc(KIB) is None
    del kept
    assert pool.num_segments == 0


def test_pinning_without_cuda_falls_back_once_with_the_reason(caplog) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: registration would succeed")
    pool = HostPool(64 * KIB, segment_bytes=64 * KIB)
    with caplog.at_level(logging.WARNING):
        blocks = [pool.alloc(KIB, torch.device("cuda", 0)) for _ in range(3)]
    assert all(b is not None for b in blocks) and not pool.is_pinned
    assert "pageable" in pool.pin_note and "no CUDA" in pool.pin_note
    assert sum("stays pageable" in r.getMessage() for r in caplog.records) == 1


def test_capture_lands_in_the_store_pool_and_drop_returns_it(tmp_path) -> None:
    cache = filled_cache(37, torch.bfloat16)
    layout = KVLayout.of(cache.kv)
    store = SnapshotStore(1 << 20, tmp_path, 1 << 20, fingerprint=FINGERPRINT, layout=layout)
    snapshot = KVSnapshot.capture(cache, pool=store.host_pool)
    assert store.host_pool.used_bytes >= snapshot.nbytes == 37 * layout.bytes_per_token
    # All regions in one block: consecutive, aligned offsets of one segment.
    pointers = [t.data_ptr() for t in snapshot.state]
    assert pointers == sorted(pointers) and pointers[-1] - pointers[0] < store.host_pool.used_bytes
    assert store.put(0, snapshot) == "ram" and store.ram_bytes == snapshot.nbytes
    del snapshot
    assert store.host_pool.used_bytes > 0  # the store still holds it
    taken = store.take(0)
    restored = SlotCache.from_state(taken.state, taken.metadata, KVCache(3, 2, 8, 64, torch.bfloat16))
    del taken
    assert all(torch.equal(a, b) for a, b in zip(restored.state, cache.state, strict=True))
    assert store.host_pool.used_bytes == 0 and store.ram_bytes == 0
    store.close()
    assert store.host_pool.alloc(KIB) is None  # closing the store closed its pool


def test_capture_into_a_full_pool_uses_ordinary_memory() -> None:
    cache = filled_cache(20)
    pool = HostPool(4 * KIB, segment_bytes=4 * KIB)
    snapshot = KVSnapshot.capture(cache, pool=pool)
    assert pool.used_bytes == 0  # 20 tokens x 6 regions x 64 B with alignment do not fit
    assert all(torch.equal(a, b) for a, b in zip(snapshot.state, cache.state, strict=True))


def test_engine_offload_goes_through_the_pool(model_dir, tmp_path) -> None:
    engine = make_engine(model_dir, tmp_path)
    pool = engine.slots.store.host_pool
    run(engine, list(range(1, 200)), slot=0)
    before = [t.clone() for t in engine.slots.resident[0].state]
    engine.slots.offload(0)
    assert locations(engine)[0] == "ram" and pool.used_bytes >= engine.slots.store.ram_bytes > 0
    engine.slots.checkout(0)
    engine.slots.checkin(0)
    after = engine.slots.resident[0].state
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert pool.used_bytes == 0  # restored: the snapshot and its block are gone
    engine.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none here")
def test_capture_and_restore_on_cuda_are_byte_identical_and_pinned() -> None:
    # 16 layers x 8 kv heads x 128 x bf16 x 16k tokens: 1 GiB, like a long session.
    num_layers, heads, head_dim, num_tokens = 16, 8, 128, 16384
    kv = KVCache(num_layers, heads, head_dim, num_tokens, torch.bfloat16, "cuda")
    for t in (*kv.k, *kv.v):
        t.copy_(torch.randn(t.shape, device="cuda", dtype=torch.bfloat16))
    cache = SlotCache(kv, FINGERPRINT, list(range(num_tokens)))
    pool = HostPool(2 << 30)
    KVSnapshot.capture(cache, pool=pool)  # warm-up: grows and registers the segment
    assert pool.is_pinned, pool.pin_note
    t0 = time.perf_counter()
    snapshot = KVSnapshot.capture(cache, pool=pool)
    offload_s = time.perf_counter() - t0
    target = KVCache(num_layers, heads, head_dim, num_tokens, torch.bfloat16, "cuda")
    t0 = time.perf_counter()
    restored = SlotCache.from_state(snapshot.state, snapshot.metadata, target)
    restore_s = time.perf_counter() - t0
    for a, b in zip(restored.state, cache.state, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # bit for bit, NaNs included
    gib = snapshot.nbytes / (1 << 30)
    print(f"\nKV snapshot {gib:.2f} GiB: capture {snapshot.nbytes / offload_s / 1e9:.1f} GB/s, "
          f"restore {snapshot.nbytes / restore_s / 1e9:.1f} GB/s ({pool.pin_note})")
