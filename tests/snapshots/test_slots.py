"""SlotManager on its own: the KV hooks are called per slot, release only after a good write."""

from __future__ import annotations

import pytest
import torch

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.slots import SlotError, SlotManager
from strata.engine.core.snapshots import KVLayout, SnapshotStore, SnapshotWriteError

LAYOUT = KVLayout(2, 2, 4, "float32")
MAX_TOKENS = 32
SLOT_BYTES = MAX_TOKENS * LAYOUT.bytes_per_token


class KVHooks:
    """make_kv / release_kv that record which slot asked: the seam the kv arena plugs into."""

    def __init__(self):
        self.made: list[int] = []
        self.released: list[tuple[int, KVCache]] = []

    def make_kv(self, slot: int) -> KVCache:
        self.made.append(slot)
        return KVCache(2, 2, 4, MAX_TOKENS)

    def release_kv(self, slot: int, kv: KVCache) -> None:
        self.released.append((slot, kv))


def manager(disk_dir, hooks: KVHooks, ram_budget_bytes: int = 1 << 20) -> SlotManager:
    store = SnapshotStore(ram_budget_bytes, disk_dir, 1 << 20, fingerprint="e" * 32, layout=LAYOUT)
    return SlotManager(4, SLOT_BYTES, hooks.make_kv, store, release_kv=hooks.release_kv)


def fill(slots: SlotManager, slot: int, num_tokens: int) -> list[torch.Tensor]:
    """Check a slot out, give it a history with random K/V, check it in; returns the used rows."""
    cache = slots.checkout(slot)
    for t in cache.kv.k + cache.kv.v:
        t[:num_tokens] = torch.randn(num_tokens, 2, 4)
    cache.tokens = list(range(num_tokens))
    rows = [t.clone() for t in cache.state]
    slots.checkin(slot)
    return rows


def test_switching_past_the_budget_snapshots_then_releases_the_lru_slot(tmp_path) -> None:
    hooks = KVHooks()
    slots = manager(tmp_path, hooks)
    rows = fill(slots, 0, 10)
    kv0 = slots.resident[0].kv
    fill(slots, 1, 5)
    assert hooks.released == [(0, kv0)]
    assert [r["location"] for r in slots.status()] == ["ram", "cpu", "empty", "empty"]
    back = slots.checkout(0)
    assert hooks.made == [0, 1, 0] and hooks.released[-1][0] == 1
    assert all(torch.equal(a, b) for a, b in zip(back.state, rows, strict=True))


def test_a_failed_write_releases_nothing(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    hooks = KVHooks()
    slots = manager(blocker, hooks, ram_budget_bytes=0)
    fill(slots, 2, 8)
    with pytest.raises(SnapshotWriteError):
        slots.offload(2)
    assert hooks.released == [] and slots.status()[2]["location"] == "cpu"


def test_a_slot_in_use_is_never_evicted_or_offloaded(tmp_path) -> None:
    hooks = KVHooks()
    slots = manager(tmp_path, hooks)
    slots.checkout(0).tokens = [1, 2, 3]
    fill(slots, 1, 4)  # over budget, but slot 0 is generating: both stay
    assert slots.status()[0]["location"] == "cpu" and slots.status()[0]["is_processing"]
    with pytest.raises(SlotError, match="generating"):
        slots.offload(0)
    with pytest.raises(SlotError, match=r"cache slot must be 0..3"):
        slots.checkout(4)


def test_no_memory_for_the_kv_keeps_the_snapshot(tmp_path) -> None:
    hooks = KVHooks()
    slots = manager(tmp_path, hooks)
    fill(slots, 0, 6)
    slots.offload(0)

    def out_of_memory(slot: int) -> KVCache:
        raise MemoryError("no room for slot KV")

    slots.make_kv = out_of_memory
    with pytest.raises(MemoryError):
        slots.checkout(0)
    assert slots.status()[0]["location"] == "ram" and slots.status()[0]["n_tokens"] == 6
    slots.make_kv = hooks.make_kv
    assert slots.checkout(0).tokens == list(range(6))


class RegionHooks(KVHooks):
    """Adds release_region, which checks that the region's bytes already reached the host."""

    def __init__(self):
        super().__init__()
        self.regions: list[int] = []
        self.slots: SlotManager | None = None

    def release_region(self, slot: int, region: int) -> None:
        self.regions.append(region)
        self.slots.resident[slot].kv.regions()[region].fill_(float("nan"))  # as if unmapped


def region_manager(disk_dir, ram_budget_bytes: int) -> tuple[SlotManager, RegionHooks]:
    hooks = RegionHooks()
    store = SnapshotStore(ram_budget_bytes, disk_dir, 1 << 20, fingerprint="e" * 32, layout=LAYOUT)
    hooks.slots = SlotManager(4, SLOT_BYTES, hooks.make_kv, store, release_kv=hooks.release_kv,
                              release_region=hooks.release_region)
    return hooks.slots, hooks


def test_an_offload_kept_in_ram_releases_each_region_after_its_copy(tmp_path) -> None:
    slots, hooks = region_manager(tmp_path, ram_budget_bytes=1 << 20)
    rows = fill(slots, 1, 9)
    assert slots.offload(1)["location"] == "ram"
    assert hooks.regions == list(range(2 * LAYOUT.num_layers))
    back = slots.checkout(1)  # wiping each region after its copy spoiled nothing
    assert all(torch.equal(a, b) for a, b in zip(back.state, rows, strict=True))


def test_an_offload_that_goes_to_disk_releases_only_after_the_write(tmp_path) -> None:
    slots, hooks = region_manager(tmp_path, ram_budget_bytes=0)  # every snapshot is a file
    rows = fill(slots, 1, 9)
    assert slots.offload(1)["location"] == "disk"
    assert hooks.regions == [] and hooks.released[-1][0] == 1
    back = slots.checkout(1)
    assert all(torch.equal(a, b) for a, b in zip(back.state, rows, strict=True))


def test_no_room_in_ram_and_a_failed_spill_releases_nothing(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    slots, hooks = region_manager(blocker, ram_budget_bytes=9 * LAYOUT.bytes_per_token)
    fill(slots, 0, 9)
    slots.offload(0)  # fills the RAM budget exactly
    fill(slots, 1, 9)
    with pytest.raises(SnapshotWriteError):  # room would need slot 0 on disk: the disk fails
        slots.offload(1)
    assert hooks.regions == list(range(2 * LAYOUT.num_layers))  # slot 0's, none of slot 1's
    assert slots.status()[1]["location"] == "cpu" and slots.status()[0]["location"] == "ram"
