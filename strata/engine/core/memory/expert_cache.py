"""The expert cache's bookkeeping: which (layer, expert) sits in which VRAM slot, and which
one a miss evicts.

Pure Python, no torch: `ExpertStore` (expert_store.py) moves the bytes; this table decides
where they go. `size_slots` turns `--expert-cache auto|all|N|<size>MiB` into a slot count.

Replacement (`policy`): "lfu" (the default) evicts the resident expert of the pool with the
lowest decayed use count: each use adds 1, and every count halves over HALF_LIFE_STEPS
steps of its layer, so a popular expert outranks one used once a while back, and a
popularity that moves is followed within a few half-lives. "lru" evicts the
least recently used. With skewed routing (a few experts of a layer take most tokens) LRU
lets a run of rare experts push the popular ones out; counts keep them
(tests/memory/test_expert_policy.py: a Zipf trace at 55% of the experts resident).
"""

from __future__ import annotations

import heapq
import re
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from strata.units import MIB

POLICIES = ("lfu", "lru")
# Steps of a layer over which an expert's use count halves. Decode's misses land a step
# after they were read (the promotion copies behind the step), so what a short memory buys
# (the last tokens' experts kept) mostly arrives too late, while it churns: at 16 steps a
# zipf trace (s 1.0, reuse 0.3) at 55% resident copied ~49 experts a token in steady state
# for 0.83 hits; at 256, ~12 for 0.85 (both with a step's lag). 256 moved the fewest bytes
# (misses read plus copies) of 16, 64, 256 and 1024 on routing_trace's zipf traces (s 1.0
# reuse 0.3; s 1.2 reuse 0.5) at 31% and 55% resident, and adapts to a new popularity
# within a few hundred tokens (tests/memory/test_expert_policy.py replays them).
HALF_LIFE_STEPS = 256.0
# Decode admits a miss (lookup(admit_all=False)) only when its count beats the victim's by
# this many uses: two counts that differ by noise no longer trade places. On the zipf trace
# (s 1.0, reuse 0.3) at 46% resident, preloaded as ExpertStore does, copies landing two steps
# late, 2 cut the experts moved a token (misses plus copies) from ~142 to ~121 over the first
# 80 tokens and from ~88 to ~79 after 300, and on the uniform trace from ~348 to ~236 and
# ~264 to ~218, settled hit rates equal (tests/memory/test_expert_policy.py replays both).
# On the GPU the 30B at 12 GiB moved what the replay said (docs/benchmarks.md, run 41).
ADMIT_MARGIN_USES = 2.0
# Counts are kept as 2 ** (age in half-lives) per use, rebased before they overflow a float.
_MAX_EXPONENT = 256.0


class ExpertCacheReleasedError(RuntimeError):
    """A lookup while the cache's VRAM is released."""


def split_slots(num_slots: int, layer_counts: Sequence[int], num_experts: int) -> list[int]:
    """Slots of each pool of layers when num_slots are shared in proportion to the pools'
    layers: never more than a pool's experts (all resident), never fewer than one layer's
    (a prefill chunk may route to every expert of a layer), so the sum may differ a little.
    One pool takes num_slots as they are."""
    total_layers = sum(layer_counts)
    if len(layer_counts) == 1:
        return [min(num_slots, total_layers * num_experts)]
    if num_slots >= total_layers * num_experts:
        return [count * num_experts for count in layer_counts]
    return [min(count * num_experts, max(num_experts, num_slots * count // total_layers))
            for count in layer_counts]


class ExpertCache:
    """Residency table (layer, expert) <-> slot; a miss evicts by `policy` (module doc).

    Slots may come in pools, each serving some layers (ExpertStore gives layers whose
    experts differ in size their own slots): a layer's experts take and evict slots of its
    pool only. Slot numbers are global: pool p owns base_p .. base_p + max_p - 1, of which
    the first `pool_slots` are in use (resize)."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int,
                 pools: Sequence[tuple[Sequence[int], int]] | None = None,
                 policy: str = "lfu", half_life_steps: float = HALF_LIFE_STEPS,
                 admit_margin_uses: float = ADMIT_MARGIN_USES):
        if min(num_layers, num_experts, num_slots) <= 0:
            raise ValueError(
                f"expert cache needs positive sizes, got num_layers={num_layers}, "
                f"num_experts={num_experts}, num_slots={num_slots}"
            )
        if policy not in POLICIES or not half_life_steps > 0:
            raise ValueError(f"expert cache policy must be one of {', '.join(POLICIES)} with a "
                             f"positive half-life, not {policy!r}, {half_life_steps}")
        self.policy = policy
        self.half_life_steps = float(half_life_steps)
        self.admit_margin_uses = float(admit_margin_uses)
        self.num_layers = num_layers
        self.num_experts = num_experts
        pools = pools if pools is not None else [(range(num_layers), num_slots)]
        self._pool_of = [-1] * num_layers  # layer -> pool; -1: no experts
        self._max: list[int] = []
        self._layer_counts: list[int] = []
        for pool, (layers, size) in enumerate(pools):
            layers = list(layers)
            if size <= 0 or not layers:
                raise ValueError(f"expert cache pool {pool} needs layers and slots")
            for layer in layers:
                if not 0 <= layer < num_layers or self._pool_of[layer] != -1:
                    raise ValueError(f"layer {layer} is outside 0..{num_layers - 1} or in "
                                     "two pools")
                self._pool_of[layer] = pool
            self._max.append(size)
            self._layer_counts.append(len(layers))
        if sum(self._max) != num_slots:
            raise ValueError(f"the pools' {sum(self._max)} slots are not num_slots={num_slots}")
        self.bases = [sum(self._max[:p]) for p in range(len(self._max))]
        self._sizes = list(self._max)  # in use: the first _sizes[p] of each pool
        self._slot_of: dict[tuple[int, int], int] = {}
        # Oldest first, one order per pool: a miss evicts within its pool.
        self._lru: list[OrderedDict[tuple[int, int], None]] = [OrderedDict() for _ in pools]
        self._free_slots = self._all_free()
        # lfu: per pool, each (layer, expert)'s use count as sum of 2 ** (clock / half-life)
        # over its uses (resident or not: a returning expert keeps its history), the clock
        # (steps of the pool's layers, rebased at _MAX_EXPONENT), and a min-heap of the
        # resident ones' (count, layer, expert), refreshed lazily when popped (a hit costs
        # a dict update, not a heap push: decode counts every routed expert every step).
        self._scores: list[dict[tuple[int, int], float]] = [{} for _ in pools]
        self._clock = [0.0] * len(pools)
        self._heaps: list[list[tuple[float, int, int]]] = [[] for _ in pools]
        self._saved: list[tuple[int, int, int]] = []  # residency at the last release
        self.is_released = False
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0
        # The same counts per layer (index: layer; dense layers stay 0).
        self.layer_hits = [0] * num_layers
        self.layer_misses = [0] * num_layers
        # Misses that admission (admit_all=False) left on the host: read there, not copied.
        self.num_left_out = 0
        self.layer_left_out = [0] * num_layers
        self.num_prefetched = 0  # experts given slots by take_for_prefetch
        self.num_filled = 0  # experts given free slots by fill_free

    @property
    def num_slots(self) -> int:
        return sum(self._sizes)

    @property
    def sizes(self) -> list[int]:
        """Slots in use in each pool, in pool order."""
        return list(self._sizes)

    @property
    def max_sizes(self) -> list[int]:
        """Slots each pool holds at most (the store's arena has room for them all)."""
        return list(self._max)

    def pool_of(self, layer: int) -> int:
        """The pool serving layer's experts (ValueError for a layer without any)."""
        if not 0 <= layer < self.num_layers or self._pool_of[layer] < 0:
            raise ValueError(f"layer {layer} has no slots (outside 0..{self.num_layers - 1} "
                             "or a dense layer)")
        return self._pool_of[layer]

    def pool_slots(self, layer: int) -> int:
        """Slots in use that layer's experts can take."""
        return self._sizes[self.pool_of(layer)]

    def _all_free(self, taken: Collection[int] = ()) -> list[list[int]]:
        """Each pool's slots in use that `taken` lacks; pop() hands out the lowest first."""
        return [[s for s in range(base + size - 1, base - 1, -1) if s not in taken]
                for base, size in zip(self.bases, self._sizes)]

    @property
    def num_resident(self) -> int:
        return len(self._slot_of)

    def slot_of(self, layer: int, expert: int) -> int | None:
        """The slot holding this expert, or None; does not count as a use."""
        return self._slot_of.get((layer, expert))

    def resident(self) -> list[tuple[int, int, int]]:
        """(layer, expert, slot) of every resident expert, pool by pool, least recently used
        first."""
        return [(layer, expert, self._slot_of[(layer, expert)])
                for lru in self._lru for layer, expert in lru]

    def lookup(
        self, layer: int, experts: Iterable[int], count_uses: bool = True,
        admit_all: bool = True,
    ) -> tuple[list[int | None], list[tuple[int, int]]]:
        """Slots for the experts one step of `layer` needs, and the misses to copy in.

        Returns (slots aligned with experts, [(expert, slot)] to fill). Experts of this call
        are never evicted by each other; a repeated expert counts once. count_uses=False
        leaves the hit/miss counters to a caller that knows better (`count`).
        admit_all=False (lfu; a caller that can read a miss where it is, as decode reads the
        host copy): a miss takes a slot only when one is free or its use count beats the
        expert it would evict by admit_margin_uses; else its slot is None and nothing
        moves. Rare experts then cost one read, not a read and a copy that evicts a more
        popular one.
        """
        if self.is_released:
            raise ExpertCacheReleasedError(
                "expert cache is released: refill it (restore_residency) before a lookup"
            )
        experts = [int(e) for e in experts]
        wanted = set(experts)
        self._check_ids(layer, wanted)
        pool = self._pool_of[layer]
        if len(wanted) > self._sizes[pool]:
            raise ValueError(
                f"one step of layer {layer} needs {len(wanted)} experts but the cache has "
                f"{self._sizes[pool]} slots; give it at least {len(wanted)}"
            )
        in_use = {(layer, e) for e in wanted}
        lru = self._lru[pool]
        use_weight = self._tick(pool)
        scores = self._scores[pool]
        admit_all = admit_all or self.policy != "lfu"
        slots: list[int | None] = []
        misses: list[tuple[int, int]] = []
        seen: dict[int, int | None] = {}
        for expert in experts:
            if expert in seen:
                slots.append(seen[expert])
                continue
            key = (layer, expert)
            slot = self._slot_of.get(key)
            # The use counts; a resident key's heap entry stays behind (counts only grow:
            # _lowest_count refreshes it), so a hit costs no heap push.
            score = scores[key] = scores.get(key, 0.0) + use_weight
            if slot is None:
                slot = self._take_slot(pool, in_use, None if admit_all
                                       else score - self.admit_margin_uses * use_weight)
                self.num_misses += int(count_uses)
                self.layer_misses[layer] += int(count_uses)
                if slot is not None:
                    self._slot_of[key] = slot
                    misses.append((expert, slot))
                    lru[key] = None
                    if self.policy == "lfu":
                        self._push(pool, key, score)
                else:
                    self.num_left_out += 1
                    self.layer_left_out[layer] += 1
            else:
                self.num_hits += int(count_uses)
                self.layer_hits[layer] += int(count_uses)
            if slot is not None:
                lru[key] = None
                lru.move_to_end(key)
            seen[expert] = slot
            slots.append(slot)
        return slots, misses

    def take_for_prefetch(self, layer: int, experts: Iterable[int],
                          keep: Collection[tuple[int, int]] = ()) -> list[tuple[int, int]]:
        """Slots for the experts of `layer` that are not resident, a guess of what a step
        will route to (fast/moe_prefetch.py): [(expert, slot)] to copy in. Each evicts the
        pool's resident expert of lowest count (lru: least recent), never one of `keep`
        or of these experts, and adds no use: the step that routes there counts it, so a
        wrong guess has the pool's lowest count and is the next victim. Stops where only
        protected experts are left to evict."""
        if self.is_released:
            raise ExpertCacheReleasedError(
                "expert cache is released: refill it (restore_residency) before a prefetch")
        experts = list(dict.fromkeys(int(e) for e in experts))
        self._check_ids(layer, set(experts))
        pool = self._pool_of[layer]
        in_use = {*keep, *((layer, e) for e in experts)}
        room = self._sizes[pool] - sum(1 for key in in_use if self._pool_of[key[0]] == pool
                                       and key in self._slot_of)
        scores, lru = self._scores[pool], self._lru[pool]
        taken: list[tuple[int, int]] = []
        for expert in experts:
            key = (layer, expert)
            if key in self._slot_of:
                continue
            if room <= 0:
                break
            slot = self._take_slot(pool, in_use)
            room -= 1
            self._slot_of[key] = slot
            lru[key] = None
            if self.policy == "lfu":
                self._push(pool, key, scores.get(key, 0.0))
            taken.append((expert, slot))
        self.num_prefetched += len(taken)
        return taken

    @property
    def num_free(self) -> int:
        """Slots in use that hold no expert: a grown cache's new ones (ExpertStore.resize
        maps them empty) until decode's misses or fill_free take them."""
        return sum(len(free) for free in self._free_slots)

    def fill_free(self, limit: int) -> list[tuple[int, int, int]]:
        """Up to `limit` free slots for experts that are not resident, the most used first
        (decayed counts; never-used ones after them, by layer and expert): [(layer, expert,
        slot)] to copy in. Adds no use and evicts nothing. Without it a grown cache's slots
        fill only as decode's misses take them, and a prefill (which admits nothing) stages
        from the host what the new slots could hold. The chosen experts take ascending slots
        in (layer, expert) order, so neighbours copy as one (contiguous_runs)."""
        if self.is_released:
            raise ExpertCacheReleasedError(
                "expert cache is released: refill it (restore_residency) before a fill")
        taken: list[tuple[int, int, int]] = []
        for pool, free in enumerate(self._free_slots):
            room = min(len(free), limit - len(taken))
            if room <= 0:
                continue
            scores = self._scores[pool]
            candidates = [(layer, expert) for layer in range(self.num_layers)
                          if self._pool_of[layer] == pool
                          for expert in range(self.num_experts)
                          if (layer, expert) not in self._slot_of]
            chosen = sorted(heapq.nsmallest(
                room, candidates, key=lambda key: (-scores.get(key, 0.0), key)))
            lru = self._lru[pool]
            for key in chosen:
                slot = free.pop()
                self._slot_of[key] = slot
                lru[key] = None
                if self.policy == "lfu":
                    self._push(pool, key, scores.get(key, 0.0))
                taken.append((*key, slot))
        self.num_filled += len(taken)
        return taken

    def _tick(self, pool: int) -> float:
        """Advance the pool's clock by one layer's step; the weight a use adds now."""
        layers = self._layer_counts[pool]
        self._clock[pool] += 1.0 / layers
        exponent = self._clock[pool] / self.half_life_steps
        if exponent > _MAX_EXPONENT:  # rebase: every count of the pool times 2 ** -exponent
            scale = 2.0 ** -exponent
            scores = self._scores[pool]
            for key in scores:
                scores[key] *= scale
            self._clock[pool], exponent = 0.0, 0.0
            self._rebuild_heap(pool)
        return 2.0 ** exponent

    def _push(self, pool: int, key: tuple[int, int], score: float) -> None:
        heap = self._heaps[pool]
        heapq.heappush(heap, (score, *key))
        if len(heap) > 4 * len(self._lru[pool]) + 64:  # mostly stale entries: compact
            self._rebuild_heap(pool)

    def _rebuild_heap(self, pool: int) -> None:
        scores = self._scores[pool]
        heap = [(scores.get(key, 0.0), *key) for key in self._lru[pool]]
        heapq.heapify(heap)
        self._heaps[pool] = heap

    def set_policy(self, policy: str) -> None:
        """Evict by `policy` from now on (counts are kept either way; a benchmark's A/B)."""
        if policy not in POLICIES:
            raise ValueError(f"expert cache policy must be one of {', '.join(POLICIES)}, "
                             f"not {policy!r}")
        self.policy = policy
        for pool in range(len(self._max)):
            self._rebuild_heap(pool)

    def use_count(self, layer: int, expert: int) -> float:
        """The expert's decayed use count now (1.0: one use this step); 0 if never used."""
        pool = self.pool_of(layer)
        score = self._scores[pool].get((layer, expert), 0.0)
        return score * 2.0 ** -(self._clock[pool] / self.half_life_steps)

    def count(self, num_hits: int, num_misses: int, layer: int | None = None) -> None:
        """Add uses that a caller classified itself, e.g. decode steps that read a missing
        expert from the host copy while its copy into a slot was still on the way; with a
        layer, that layer's counts too."""
        if num_hits < 0 or num_misses < 0:
            raise ValueError(f"hit and miss counts must be >= 0, got {num_hits}, {num_misses}")
        self.num_hits += num_hits
        self.num_misses += num_misses
        if layer is not None:
            self.layer_hits[layer] += num_hits
            self.layer_misses[layer] += num_misses

    def _check_ids(self, layer: int, experts: set[int]) -> None:
        self.pool_of(layer)
        bad = sorted(e for e in experts if not 0 <= e < self.num_experts)
        if bad:
            raise ValueError(f"expert ids {bad} are outside 0..{self.num_experts - 1}")

    def _take_slot(self, pool: int, in_use: set[tuple[int, int]],
                   must_beat: float | None = None) -> int | None:
        """A free slot, else the victim's; None (nothing evicted) when must_beat is set and
        the victim's count is not below it."""
        if self._free_slots[pool]:
            return self._free_slots[pool].pop()
        lru = self._lru[pool]
        if self.policy == "lfu":
            victim = self._lowest_count(pool, in_use, must_beat)
            if victim is None:
                return None
        else:
            victim = next(key for key in lru if key not in in_use)
        del lru[victim]
        self.num_evictions += 1
        return self._slot_of.pop(victim)

    def _lowest_count(self, pool: int, in_use: set[tuple[int, int]],
                      must_beat: float | None = None) -> tuple[int, int] | None:
        """The resident expert of the pool with the lowest use count, not one of in_use;
        None when must_beat is set and that count is not below it (it stays)."""
        heap, scores, lru = self._heaps[pool], self._scores[pool], self._lru[pool]
        kept: list[tuple[float, int, int]] = []
        try:
            # Every resident key has an entry no higher than its count (counts only grow):
            # an entry that is up to date is the lowest count.
            while heap:
                entry = heap[0]
                key = entry[1:]
                if key not in lru:
                    heapq.heappop(heap)  # evicted since
                    continue
                score = scores.get(key, 0.0)
                if score != entry[0]:  # used since: its entry moves up to its count
                    heapq.heapreplace(heap, (score, *key))
                    continue
                if key in in_use:
                    kept.append(heapq.heappop(heap))
                    continue
                if must_beat is not None and entry[0] >= must_beat:
                    return None
                heapq.heappop(heap)
                return key  # type: ignore[return-value]
        finally:
            for entry in kept:
                heapq.heappush(heap, entry)
        raise RuntimeError("expert cache: no resident expert outside this step to evict")

    def pool_sizes(self, num_slots: int) -> list[int]:
        """Slots each pool would use if the cache used num_slots (split_slots, capped by
        what each pool holds at most)."""
        return [min(size, limit) for size, limit in
                zip(split_slots(num_slots, self._layer_counts, self.num_experts), self._max)]

    def resize(self, num_slots: int) -> list[int]:
        """Use about num_slots slots from now on (shrink_experts, and growing back), shared by
        the pools as `pool_sizes` says: experts in a pool's slots past its new size leave the
        table. Returns the slots they left, for the device table."""
        if num_slots <= 0:
            raise ValueError(f"the expert cache needs at least one slot, not {num_slots}")
        if self.is_released:
            raise ExpertCacheReleasedError("the expert cache is released: refill it first")
        self._sizes = self.pool_sizes(num_slots)
        ends = [base + size for base, size in zip(self.bases, self._sizes)]
        evicted = [(key, slot) for key, slot in self._slot_of.items()
                   if slot >= ends[self._pool_of[key[0]]]]
        for key, _ in evicted:
            del self._slot_of[key]
            del self._lru[self._pool_of[key[0]]][key]
        self._free_slots = self._all_free(set(self._slot_of.values()))
        return [slot for _, slot in evicted]

    def mark_all_released(self) -> None:
        """The slots' VRAM is going away: remember who was resident, then empty the table."""
        if self.is_released:
            return
        self._saved = self.resident()
        self._slot_of.clear()
        for lru in self._lru:
            lru.clear()
        self._free_slots = self._all_free()
        self.is_released = True

    def restore_residency(self) -> list[tuple[int, int, int]]:
        """Put back the residency of the last release (same slots, same LRU order) and return
        it as (layer, expert, slot) for the caller to copy in; [] when not released."""
        if not self.is_released:
            return []
        for layer, expert, slot in self._saved:
            self._slot_of[(layer, expert)] = slot
            self._lru[self._pool_of[layer]][(layer, expert)] = None
        for pool in range(len(self._max)):
            self._rebuild_heap(pool)
        self._free_slots = self._all_free({slot for _, _, slot in self._saved})
        restored, self._saved = self._saved, []
        self.is_released = False
        return restored

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy, plain values for /v1/status and /metrics."""
        lookups = self.num_hits + self.num_misses
        return {
            "num_slots": self.num_slots,
            "num_resident": self.num_resident,
            "num_hits": self.num_hits,
            "num_misses": self.num_misses,
            "num_evictions": self.num_evictions,
            "num_left_out": self.num_left_out,
            "num_free_slots": self.num_free,
            "num_filled": self.num_filled,
            "policy": self.policy,
            "hit_rate": self.num_hits / lookups if lookups else None,
            "is_released": self.is_released,
        }


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(mib|gib)\s*$", re.IGNORECASE)


def size_slots(
    spec: str | int,
    bytes_per_expert: int,
    free_bytes: int,
    reserve_bytes: int,
    total_experts: int,
    min_slots: int = 1,
) -> int:
    """Slots for `--expert-cache spec`: 'auto' (free VRAM minus the reserve), 'all', a count
    N, or a size like '8192MiB'/'8GiB'. Never more than total_experts (all resident)."""
    if bytes_per_expert <= 0 or total_experts <= 0:
        raise ValueError("size_slots needs positive bytes_per_expert and total_experts")
    text = str(spec).strip().lower()
    size_match = _SIZE_RE.match(text)
    if text == "auto":
        slots = max(free_bytes - reserve_bytes, 0) // bytes_per_expert
        why = (
            f"{free_bytes / MIB:.0f} MiB free minus a {reserve_bytes / MIB:.0f} MiB reserve "
            f"holds {slots} experts of {bytes_per_expert / MIB:.1f} MiB"
        )
        fix = "free VRAM or lower the reserve"
    elif text == "all":
        return total_experts
    elif text.isdigit():
        slots, why, fix = int(text), f"{text} slots asked", "ask for more"
    elif size_match:
        unit = MIB if size_match.group(2) == "mib" else 1024 * MIB
        slots = int(float(size_match.group(1)) * unit) // bytes_per_expert
        why = f"{spec} holds {slots} experts of {bytes_per_expert / MIB:.1f} MiB"
        fix = "give it more"
    else:
        raise ValueError(
            f"--expert-cache {spec!r} is not understood: use auto, all, a slot count (64) or "
            "a size (8192MiB)"
        )
    if slots < min_slots:
        raise ValueError(f"--expert-cache {spec}: {why}, fewer than the {min_slots} needed; {fix}")
    return min(slots, total_experts)
