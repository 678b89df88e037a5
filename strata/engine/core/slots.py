"""Conversation cache slots: which slots hold KV memory, and snapshots of the ones that don't.

Each slot is in one place at a time: resident (a live SlotCache with its KV buffers), stored
(a snapshot in the SnapshotStore, RAM or disk) or empty. While the KV budget allows, inactive
slots stay resident and switching between them costs nothing; past it, or on offload, the least
recently used slot is snapshotted (only its used tokens) and its KV buffers are released. The
next checkout of that slot restores it; a snapshot that fails verification is dropped and the
slot starts with an empty history, so the request is still answered, only without reuse.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from strata.engine.core.batch.slot_choice import IdleSlot
from strata.engine.core.kv_cache import KVCache
from strata.engine.core.snapshots.errors import SnapshotInvalid, SnapshotWriteError
from strata.engine.core.snapshots.kv_state import KVSnapshot, SlotCache
from strata.engine.core.snapshots.store import SnapshotStore
from strata.errors import StrataError

log = logging.getLogger(__name__)


class SlotError(StrataError):
    """A slot request that cannot be served as asked; the message says why."""


class SlotManager:
    """Slots 0..num_slots-1 over a KV budget in bytes (0: every slot may stay resident)."""

    def __init__(
        self,
        num_slots: int,
        kv_budget_bytes: int,
        make_kv: Callable[[int], KVCache],
        store: SnapshotStore,
        release_kv: Callable[[int, KVCache], None] | None = None,
        release_region: Callable[[int, int], object] | None = None,
    ):
        """make_kv(slot) gives an empty KV cache for a slot; release_kv(slot, kv) hands one back.

        Without release_kv a released cache is simply dropped (torch frees its buffers). The kv
        arena plugs in through both: per-slot views at fixed addresses, pages unmapped on release.
        release_region(slot, i), when given, frees region i of an offloading slot as soon as its
        copy is on the host, so unmapping overlaps the remaining copies.
        """
        if num_slots <= 0 or kv_budget_bytes < 0:
            raise ValueError(f"need num_slots > 0 and kv_budget_bytes >= 0, not {num_slots}, "
                             f"{kv_budget_bytes}")
        self.num_slots = num_slots
        self.kv_budget_bytes = kv_budget_bytes
        self.make_kv = make_kv
        self.release_kv = release_kv
        self.release_region = release_region
        self.store = store
        self.resident: dict[int, SlotCache] = {}
        # Slots with a sequence running: never evicted, offloaded or erased under it. Several
        # at once under continuous batching, each over its own KV range.
        self.in_use: set[int] = set()
        # Of each slot stored as a snapshot: its token ids and when it was last used, so that
        # slot choice (batch/slot_choice.py) sees a stored conversation as well as a resident one.
        self._stored: dict[int, tuple[tuple[int, ...], float]] = {}
        for slot in range(num_slots):  # persisted sessions of an earlier engine
            tokens = store.stored_tokens(slot)
            if tokens:
                self._stored[slot] = (tokens, 0.0)
        self.last_restore: dict[str, Any] | None = None  # what the last checkout restored
        self.last_error: str | None = None
        self.session_slots: list[int] = []  # what the last offload_session stored, LRU first

    # ---- checkout ----------------------------------------------------------------------------

    def check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise SlotError(f"cache slot must be 0..{self.num_slots - 1}, not {slot}")

    def checkout(self, slot: int) -> SlotCache:
        """Make `slot` resident (restoring its snapshot if it has one) and mark it in use."""
        self.check_slot(slot)
        cache = self.resident.get(slot)
        if cache is None:
            cache = self._bring_in(slot)
        cache.last_used_s = time.monotonic()
        self.in_use.add(slot)
        return cache

    def checkin(self, slot: int) -> None:
        """The generation on `slot` ended; it may be evicted again."""
        self.in_use.discard(slot)
        if slot in self.resident:
            self.resident[slot].last_used_s = time.monotonic()

    def idle_slots(self) -> list[IdleSlot]:
        """Every slot no sequence holds, with the token ids it caches (resident or stored)."""
        rows = []
        for slot in range(self.num_slots):
            if slot in self.in_use:
                continue
            cache, info = self.resident.get(slot), self.store.info(slot)
            if cache is not None:
                rows.append(IdleSlot(slot, cache.tokens, len(cache.tokens), cache.last_used_s))
            elif info is not None:
                # A file of an earlier run: its ids are unknown until a restore reads it.
                tokens, last_used_s = self._stored.get(slot, ((), 0.0))
                rows.append(IdleSlot(slot, tokens, max(info["n_tokens"], 1), last_used_s))
            else:
                rows.append(IdleSlot(slot, (), 0, 0.0))
        return rows

    def _bring_in(self, slot: int) -> SlotCache:
        started_s = time.perf_counter()
        self._make_room()
        source = (self.store.info(slot) or {}).get("location")
        self.last_restore = {"slot": slot, "source": source, "n_restored": 0, "dropped": None}
        try:
            snapshot = self.store.take(slot)
        except SnapshotInvalid as exc:
            # Drop it and start over: the request is answered from a cold prefill.
            log.warning("slot %d: %s; its history is cleared", slot, exc)
            self.last_restore["dropped"] = exc.reason
            snapshot = None
        try:
            cache = self._install(slot, snapshot)
        except BaseException:
            if snapshot is not None:  # no KV memory for it (out of memory): keep the history
                self.store.put(slot, snapshot)
            raise
        if snapshot is not None:
            self.last_restore["n_restored"] = len(cache.tokens)
        self.last_restore["restore_ms"] = round((time.perf_counter() - started_s) * 1000, 3)
        return cache

    def _install(self, slot: int, snapshot: KVSnapshot | None) -> SlotCache:
        """A resident cache for `slot`: fresh KV, filled from `snapshot` when one is given."""
        kv = self.make_kv(slot)
        if snapshot is None:
            cache = SlotCache(kv, self.store.fingerprint)
        else:
            try:
                cache = SlotCache.from_state(snapshot.state, snapshot.metadata, kv)
            except SnapshotInvalid as exc:
                log.warning("slot %d: %s; its history is cleared", slot, exc)
                self.last_restore = {**(self.last_restore or {}), "dropped": exc.reason}
                cache = SlotCache(kv, self.store.fingerprint)
        self.resident[slot] = cache
        return cache

    def _make_room(self) -> None:
        """Evict least recently used idle slots until one more slot fits the KV budget."""
        if self.kv_budget_bytes == 0:
            return
        while self.resident:
            slot_bytes = max(c.nbytes for c in self.resident.values())
            if sum(c.nbytes for c in self.resident.values()) + slot_bytes <= self.kv_budget_bytes:
                return
            idle = [s for s in self.resident if s not in self.in_use]
            if not idle:
                return  # everything resident is generating; the budget is a target, not a wall
            victim = min(idle, key=lambda s: self.resident[s].last_used_s)
            try:
                self.offload(victim)
            except SnapshotWriteError as exc:
                # Nothing is lost: the slot stays resident, over budget, and status says why.
                self.last_error = str(exc)
                log.warning("could not evict slot %d: %s", victim, exc)
                return

    def _release(self, slot: int) -> None:
        """Give a resident slot's KV storage back: to the arena if there is one, else to torch."""
        cache = self.resident.pop(slot)
        kv, cache.kv = cache.kv, None
        if self.release_kv is not None:
            self.release_kv(slot, kv)

    # ---- offload -----------------------------------------------------------------------------

    def offload(self, slot: int) -> dict[str, Any]:
        """Snapshot a resident slot and release its KV; raises SnapshotWriteError (KV kept)."""
        self.check_slot(slot)
        if slot in self.in_use:
            raise SlotError(f"slot {slot} is generating: offload it after the request ends")
        cache = self.resident.get(slot)
        if cache is None:
            return {"id_slot": slot, "released_bytes": 0, "location": self._location(slot)}
        released_bytes = cache.nbytes
        if not cache.tokens:
            self._release(slot)  # an empty history needs no snapshot
            return {"id_slot": slot, "released_bytes": released_bytes, "location": "empty"}
        created_s, expires_s = self.store.expiry_for_new()
        on_region_copied = None
        # Regions may go back while the copy runs only once the snapshot is sure to be kept:
        # make_room spills older snapshots first (raising, with nothing released, if it cannot).
        if self.release_region is not None and self.store.make_room(self._state_bytes(cache)):
            def on_region_copied(region: int) -> None:
                self.release_region(slot, region)
        try:
            snapshot = KVSnapshot.capture(cache, created_s, expires_s, pool=self.store.host_pool,
                                          on_region_copied=on_region_copied)
        except BaseException:
            if on_region_copied is not None:
                self._release(slot)  # some regions may be gone: the history cannot stay resident
            raise
        location = self.store.put(slot, snapshot)  # raises before anything is released
        self._stored[slot] = (tuple(cache.tokens), cache.last_used_s)
        # Release only now that the snapshot is complete (the rest, with early release).
        self._release(slot)
        return {"id_slot": slot, "released_bytes": released_bytes, "location": location,
                "n_tokens": snapshot.num_tokens, "snapshot_bytes": snapshot.nbytes}

    @staticmethod
    def _state_bytes(cache: SlotCache) -> int:
        return sum(t.nbytes for t in cache.state)

    def offload_session(self) -> dict[str, Any]:
        """Snapshot every resident idle slot and release its KV memory.

        Tries them all; a slot that cannot be written stays resident (its memory is released
        only once its write completed), and SnapshotWriteError names every such slot after the
        others are done; its `failed_slots` lists them and `code` is the first failure's.
        """
        results, failures = [], []
        for slot in sorted(self.resident, key=lambda s: self.resident[s].last_used_s):
            if slot in self.in_use:
                continue
            try:
                results.append(self.offload(slot))
            except SnapshotWriteError as exc:
                failures.append((slot, exc))
            except OSError as exc:  # a raw errno that slipped past the store: still a write error
                failures.append((slot, SnapshotWriteError.from_os_error(
                    f"could not write slot {slot}'s KV snapshot", exc)))
        self.session_slots = [r["id_slot"] for r in results if r["location"] in ("ram", "disk")]
        if failures:
            failed_slots = [slot for slot, _ in failures]
            first = failures[0][1]
            self.last_error = f"slot {failed_slots[0]}: {first}"
            done = [r["id_slot"] for r in results]
            error = SnapshotWriteError(
                f"offload kept slot(s) {', '.join(map(str, failed_slots))} in memory "
                f"(offloaded: {', '.join(map(str, done)) or 'none'}): {first}", first.code)
            error.failed_slots = failed_slots
            raise error
        return {
            "offloaded_slots": [r["id_slot"] for r in results],
            "released_bytes": sum(r["released_bytes"] for r in results),
            "snapshot_bytes": sum(r.get("snapshot_bytes", 0) for r in results),
            "locations": {r["id_slot"]: r["location"] for r in results},
        }

    def restore_session(self) -> dict[str, Any]:
        """Bring back the most recently used slot of the last offload_session, if still stored."""
        stored = [s for s in self.session_slots if self.store.info(s) is not None]
        self.session_slots = []
        if not stored:
            return {"restored_slots": []}
        slot = stored[-1]
        self.checkout(slot)
        self.checkin(slot)
        return {"restored_slots": [slot], **(self.last_restore or {})}

    # ---- explicit save / restore / erase (llama.cpp's /slots/{id}?action=...) --------------

    def save(self, slot: int, filename: str) -> dict[str, Any]:
        """Write the slot's history to `filename` in the snapshot directory."""
        self.check_slot(slot)
        started_s = time.perf_counter()
        path = self.store.named_path(filename)  # checks the name before any work
        cache = self.resident.get(slot)
        if cache is None and self.store.info(slot) is not None:
            cache = self.checkout(slot)
            self.checkin(slot)
        if cache is None or not cache.tokens:
            raise SlotError(f"slot {slot} is empty: there is nothing to save")
        written = self.store.save_named(path.name, KVSnapshot.capture(cache))
        return {"id_slot": slot, "filename": path.name, "n_saved": len(cache.tokens),
                "n_written": written,
                "timings": {"save_ms": round((time.perf_counter() - started_s) * 1000, 3)}}

    def restore(self, slot: int, filename: str) -> dict[str, Any]:
        """Replace the slot's history with `filename`; the slot is unchanged if it fails."""
        self.check_slot(slot)
        if slot in self.in_use:
            raise SlotError(f"slot {slot} is generating: restore it after the request ends")
        started_s = time.perf_counter()
        snapshot, read_bytes = self.store.load_named(filename)  # verifies everything
        self.erase(slot)
        self._make_room()
        cache = self._install(slot, snapshot)
        cache.last_used_s = time.monotonic()
        return {"id_slot": slot, "filename": filename, "n_restored": len(cache.tokens),
                "n_read": read_bytes,
                "timings": {"restore_ms": round((time.perf_counter() - started_s) * 1000, 3)}}

    def erase(self, slot: int) -> dict[str, Any]:
        """Forget the slot's history wherever it is and release its memory."""
        self.check_slot(slot)
        if slot in self.in_use:
            raise SlotError(f"slot {slot} is generating: erase it after the request ends")
        cache = self.resident.get(slot)
        if cache is not None:
            self._release(slot)
        info = self.store.info(slot)
        self.store.drop(slot)
        num_erased = len(cache.tokens) if cache else (info or {}).get("n_tokens", 0)
        return {"id_slot": slot, "n_erased": num_erased}

    # ---- status and lifetime -----------------------------------------------------------------

    def _location(self, slot: int) -> str:
        if slot in self.resident:
            return "gpu" if self.resident[slot].kv.device.type == "cuda" else "cpu"
        info = self.store.info(slot)
        return info["location"] if info else "empty"

    def status(self) -> list[dict[str, Any]]:
        """Per slot: id, n_tokens, location (gpu|cpu: resident; ram, disk, empty), bytes, and
        whether a sequence runs in it (is_running; is_processing is the older name)."""
        rows = []
        for slot in range(self.num_slots):
            cache, info = self.resident.get(slot), self.store.info(slot)
            if cache is not None:
                n_tokens, nbytes = len(cache.tokens), cache.nbytes
            else:
                n_tokens, nbytes = (info["n_tokens"], info["bytes"]) if info else (0, 0)
            is_running = slot in self.in_use
            rows.append({"id": slot, "n_tokens": n_tokens, "location": self._location(slot),
                         "bytes": nbytes, "is_processing": is_running, "is_running": is_running})
        return rows

    @property
    def resident_bytes(self) -> int:
        return sum(c.nbytes for c in self.resident.values())

    def release_all_kv(self, keep: bool) -> None:
        """Release every slot's KV (an unload or close); with keep or a persistent store each
        history goes to a snapshot first (RAM first; finish_for_exit() writes named files)."""
        if keep or self.store.is_persistent:
            for slot in list(self.resident):
                self.in_use.discard(slot)
                try:
                    self.offload(slot)
                except SnapshotWriteError as exc:
                    log.warning("slot %d's history is lost: %s", slot, exc)
        for slot in list(self.resident):
            self._release(slot)
        self.in_use.clear()

    def finish_for_exit(self, keep_sessions_as: str | None) -> list[int]:
        """After release_all_kv, with no GPU needed (the context may be gone): write each
        stored history to keep_sessions_as.format(slot=N); persistent sessions to their files.
        The host memory is left to the exit. Returns the slots kept."""
        kept: list[int] = []
        if keep_sessions_as is not None:
            for slot in range(self.num_slots):
                try:
                    snapshot = self.store.take(slot)
                    if snapshot is None:
                        continue
                    self.store.save_named(keep_sessions_as.format(slot=slot), snapshot)
                    kept.append(slot)
                except (SnapshotInvalid, SnapshotWriteError, OSError) as exc:
                    log.warning("slot %d's session is not kept over the unload: %s", slot, exc)
        self.store.close(free_host_memory=False)
        return kept

    def close(self) -> None:
        """Release all KV; with a persistent store, histories are written to disk first."""
        self.release_all_kv(keep=False)
        self.store.close()
