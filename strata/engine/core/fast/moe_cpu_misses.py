"""A partial expert cache's misses computed on the CPU during one-token decode (issue 54).

A miss read in place over PCIe costs ~300 us an expert where small reads run ~10 GB/s
(2.86 MB of Qwen3-30B-A3B Q4_K_M), where llama.cpp computes one on 16 CPU threads in ~57 us.
With `cpu_expert_misses` on, a one-token MoE layer over the slot table:

1. routes on the GPU as before (the router leaves the ids in step_ids for promotion);
2. copies ids, weights and x to the host (a sync) and splits the ids by the host mirror of
   the slot table, which the device table equals for the kernels queued now (the
   promotion publishes both at once, ExpertStore.update_table);
3. hands the misses to a worker thread, which computes them from the CPU forms of the
   host copy (memory/cpu_expert_cache.py, quant/cpu_experts.py);
4. meanwhile queues the GPU's expert kernels unchanged for the hits, the misses replaced
   by a hit's id with weight 0 (a second read of a slot, from VRAM), or none when all missed;
5. adds the CPU's [H] sum, copied to the device, to the GPU's.

A miss is computed on the CPU only when its CPU form is kept; the others are read over PCIe
as before and their conversion is queued on a second worker for the next time. Converting
on the decode path (19-43 ms an expert) held run 38's 30B at 1 tok/s. "on" also queues, as
it starts, the forms of every expert (those without a slot first) up to the cache's bound;
"auto" makes only those of experts that missed. `LayerCpuMisses.routed` does all
this in one call (called steps); its phases stage / split / hits / join / combine do it
across the segments of a step cut for graphs (forward.decode_step_segments,
split_runner.py), split and join being the host's work between two segments. A layer
captured whole (a batch graph's row) reads its misses in place as before. With a prefetch
(`start_prefetch`, fast/moe_prefetch.py) a split first publishes the copies that landed, and
once the hits are queued the host guesses the next MoE layer's experts and copies them in.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from strata.engine.core.engine_config import check_cpu_expert_misses
from strata.engine.core.fast.cpu_share import GpuProbe, ShareBalance
from strata.engine.core.fast.moe_prefetch import ExpertPrefetch, Guess
from strata.engine.core.memory.cpu_expert_cache import CpuExpertCache
from strata.engine.core.memory.expert_store import ExpertStore
from strata.engine.core.quant.cpu_experts import HostEpilogue, routed_ffn

GpuExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, weights) -> [1, H]
HOST_TIMES = ("cpu_split_wait_s", "cpu_split_host_s", "cpu_join_wait_s", "cpu_join_host_s")


class CpuMisses:
    """The CPU half of a partial cache's one-token decode: the CPU forms, the workers, and
    each MoE layer's view (`for_layer`, which SlotLayout carries)."""

    def __init__(self, store: ExpertStore, mode: str, limit_bytes: int,
                 model_dtype: torch.dtype):
        if check_cpu_expert_misses(mode) == "off":
            raise ValueError("CpuMisses is for cpu_expert_misses on or auto")
        self.store = store
        self.mode = mode
        # At most this many of a layer's misses a token go to the CPU, the rest read in place
        # (None: every miss whose CPU form is kept). Both at once split a layer's misses
        # between the CPU's threads and the link, where either alone is the slower.
        self.max_per_layer: int | None = None
        # Or this fraction of a layer's misses (rounded up): the CPU's share where an expert
        # costs its threads about what the link takes to read it in place (run 37: ~90 us on
        # 8 threads, ~93 us for 3 MB at 33 GB/s), so a layer's m misses take about
        # m/2 expert times on either side, whatever m the routing gives.
        self.share: float | None = None
        # Or each layer's own share, from `share` (else half), moved a step a token toward
        # where the CPU and the GPU finish the layer at once (fast/cpu_share.py).
        self.balance = False
        # The next MoE layer's likely experts copied in while this one computes
        # (fast/moe_prefetch.py; start_prefetch); None: off.
        self.prefetch: ExpertPrefetch | None = None
        self.promotion: Any = None  # the decode's ExpertPromotion (residency.py sets it)
        self.cache = CpuExpertCache(store, limit_bytes, model_dtype)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="cpu-experts")
        self._convert = ThreadPoolExecutor(1, thread_name_prefix="cpu-expert-forms")
        self._lock = threading.Lock()  # the conversions queued
        self._converting: set[tuple[int, int]] = set()
        self._epilogues: dict[int, HostEpilogue | None] = {}
        self.balances: dict[int, ShareBalance] = {}  # with balance: layer -> its share
        # One-token MoE layers split on the host, and those of them whose hits the GPU
        # computed while the CPU computed their misses.
        self.num_layer_calls = 0
        self.num_overlapped_calls = 0
        # Where the split step's host time goes, summed over its layers (seconds): waiting
        # for the GPU to reach the split, the split's own work (the GPU idles meanwhile),
        # waiting for the CPU's sum at the join, and the join's other work.
        self.host_seconds = dict.fromkeys(HOST_TIMES, 0.0)
        if mode == "on":
            self._convert.submit(self._convert_all)

    def start_prefetch(self, count: int, guess: Guess | None = None) -> ExpertPrefetch:
        """Prefetch up to count guessed experts of the next MoE layer at each split (guess:
        the next router's, RouterGuess, unless given); needs the decode's promotion."""
        if self.promotion is None:
            raise ValueError("expert prefetch needs a host copy the GPU reads in place "
                             "(the decode's promotion); this store has none")
        self.prefetch = ExpertPrefetch(self.store, count, guess)
        return self.prefetch

    def for_layer(self, layer: int) -> LayerCpuMisses:
        """Layer's view, for its SlotLayout."""
        return LayerCpuMisses(self, layer)

    def is_kept(self, layer: int, expert: int) -> bool:
        """Whether the expert's CPU form is ready: kept, or a float expert's (views of the
        host copy, made at once)."""
        return not self.store.is_quantized or (layer, expert) in self.cache

    def convert_later(self, layer: int, expert: int) -> None:
        """Queue one expert's conversion on the second worker (once while queued)."""
        key = (layer, expert)
        with self._lock:
            if key in self._converting or key in self.cache:
                return
            self._converting.add(key)

        def convert() -> None:
            try:
                with torch.inference_mode():
                    self.cache.expert(layer, expert)
            finally:
                with self._lock:
                    self._converting.discard(key)

        self._convert.submit(convert)

    def epilogue(self, layer: int, moe) -> HostEpilogue | None:
        """Layer's expert epilogue with host biases (made once a layer)."""
        if layer not in self._epilogues:
            from strata.engine.core.fast import expert_epilogue

            self._epilogues[layer] = HostEpilogue.of(expert_epilogue.of(moe))
        return self._epilogues[layer]

    def submit(self, layer: int, x: torch.Tensor, expert_ids: list[int],
               weights: list[float], epilogue: HostEpilogue | None) -> Future:
        """Compute sum_k w_k * FFN_k(x) of these experts on the compute worker: a Future of
        float32 [H]."""
        def compute() -> torch.Tensor:
            with torch.inference_mode():  # grad mode is per thread: this one's too
                experts = [self.cache.expert(layer, e) for e in expert_ids]
                return routed_ffn(x, experts, expert_ids, weights, epilogue)

        return self._compute.submit(compute)

    def _convert_all(self) -> None:
        """"on"'s start: the CPU forms of the experts without a slot, then of the others (a
        slot's expert misses once evicted), while they fit the cache's bound."""
        self.preconvert()
        self.preconvert(slotted=True)

    def preconvert(self, slotted: bool = False) -> int:
        """Make the CPU forms of the experts with no slot now (with slotted, of those with
        one), layer by layer, while they fit the cache's bound ("on"'s start, on the
        conversion worker; a benchmark's warm-up); returns how many were made."""
        cache, store = self.cache, self.store
        made, largest = 0, 0
        with torch.inference_mode():
            for layer in store.layer_ids:
                unslotted = store.table_mirror[layer] < 0
                for expert in (~unslotted if slotted else unslotted).nonzero()[:, 0].tolist():
                    if (layer, expert) in cache:
                        continue
                    if cache.nbytes + largest > cache.limit_bytes:
                        return made
                    largest = max(largest, cache.expert(layer, expert).nbytes)
                    made += 1
        return made

    def wait_converted(self) -> None:
        """Block until the queued conversions are done (tests, benchmarks' warm-up)."""
        self._convert.submit(lambda: None).result()

    def status(self) -> dict:
        """The CPU forms' cache and the mode, as plain values; with balance, the layers'
        mean CPU share."""
        shares = [b.share for b in self.balances.copy().values()]  # a C-level copy: a
        # status read from another thread never iterates while the decode adds a layer
        return {"cpu_expert_misses": self.mode, "num_cpu_split_layers": self.num_layer_calls,
                "num_cpu_overlapped_layers": self.num_overlapped_calls,
                **self.host_seconds,
                **({"cpu_share_mean": sum(shares) / len(shares)} if shares else {}),
                **(self.prefetch.status() if self.prefetch is not None else {}),
                **self.cache.status()}

    def balance_of(self, layer: int) -> ShareBalance:
        """Layer's balanced share (made on its first use, from `share` or a half)."""
        if layer not in self.balances:
            self.balances[layer] = ShareBalance(0.5 if self.share is None else self.share)
        return self.balances[layer]

    def close(self) -> None:
        """Stop the workers (queued conversions are dropped) and drop the CPU forms."""
        self._convert.shutdown(wait=True, cancel_futures=True)
        self._compute.shutdown(wait=True)
        self.cache.clear()


class _SplitBuffers:
    """One layer's fixed buffers for the split step (a CUDA graph's segments keep their
    addresses): the token's ids, weights and x on the host, the hits' ids and weights on
    the device, the CPU's sum on the host and the device. Pinned on a GPU."""

    def __init__(self, ids: torch.Tensor, weights: torch.Tensor, hidden: int,
                 x_dtype: torch.dtype):
        k, device = ids.shape[0], ids.device
        pin = device.type == "cuda"
        self.ids_host = torch.zeros(k, dtype=ids.dtype, pin_memory=pin)
        self.weights_host = torch.zeros(k, dtype=torch.float32, pin_memory=pin)
        self.x_host = torch.zeros(hidden, dtype=x_dtype, pin_memory=pin)
        self.hit_ids_host = torch.zeros(k, dtype=ids.dtype, pin_memory=pin)
        self.hit_weights_host = torch.zeros(k, dtype=weights.dtype, pin_memory=pin)
        self.out_host = torch.zeros(hidden, dtype=torch.float32, pin_memory=pin)
        self.hit_ids = torch.zeros(k, dtype=ids.dtype, device=device)
        self.hit_weights = torch.zeros(k, dtype=weights.dtype, device=device)
        self.cpu_out = torch.zeros(hidden, dtype=torch.float32, device=device)
        self.future: Future | None = None
        # With prefetch, what join needs of split (split says what).
        self.moe: Any = None
        self.read_ids: list[int] = []
        self.queued: torch.cuda.Event | None = None


class LayerCpuMisses:
    """One MoE layer's CPU-computed misses (SlotLayout.cpu_misses): `routed` in one call
    (a sync inside), or the split step's phases stage / split / hits / join / combine, of
    which split and join are the host's work between a graph's segments."""

    def __init__(self, shared: CpuMisses, layer: int):
        self.shared = shared
        self.layer = layer
        self._buffers: _SplitBuffers | None = None
        self._probe: GpuProbe | None = None

    def _choose(self, expert_ids: list[int]) -> list[int]:
        """Indices of the routed experts the CPU computes: the misses by the host mirror of
        the slot table whose CPU form is kept, at most max_per_layer of them and share of
        the misses, the layer's balanced share with balance (the rest are read in place,
        those without a form queued for conversion: never converted on the decode path)."""
        shared = self.shared
        table = shared.store.table_mirror[self.layer]
        missed = [i for i, e in enumerate(expert_ids) if int(table[e]) < 0]
        kept = [i for i in missed if shared.is_kept(self.layer, expert_ids[i])]
        for i in missed:
            if i not in kept:
                shared.convert_later(self.layer, expert_ids[i])
        shared.num_layer_calls += 1
        count = len(kept)
        if shared.balance:
            count = min(count, shared.balance_of(self.layer).count(len(missed)))
        elif shared.share is not None:
            count = min(count, math.ceil(len(missed) * shared.share))
        if shared.max_per_layer is not None:
            count = min(count, shared.max_per_layer)
        return kept[:count]

    def _submit(self, moe, x_host: torch.Tensor, expert_ids: list[int], weights: list[float],
                on_cpu: list[int]) -> Future:
        shared = self.shared
        shared.store.traffic.note_cpu_experts(self.layer, len(on_cpu))
        return shared.submit(self.layer, x_host, [expert_ids[i] for i in on_cpu],
                             [weights[i] for i in on_cpu], shared.epilogue(self.layer, moe))

    def routed(self, moe, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               gpu: GpuExperts) -> torch.Tensor:
        """One token's routed experts, x [1, H], ids and weights [k] on the device -> [1, H]:
        hits by `gpu` (the slot-table kernels), misses on the CPU, both at once."""
        if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return gpu(ids, weights)  # a graph cannot wait for the host: misses in place
        expert_ids = ids.tolist()  # the sync: the host decides which experts it computes
        self._land(expert_ids)
        on_cpu = self._choose(expert_ids)
        queued = self._queued(x.device)
        x_host = (x[0].to("cpu", self.shared.cache.dtype)
                  if on_cpu or self.shared.prefetch is not None else None)
        if not on_cpu:
            out = gpu(ids, weights)
            self._start_prefetch(moe, x_host, expert_ids, queued)
            return out
        routed_weights = weights.float().tolist()
        future = self._submit(moe, x_host, expert_ids, routed_weights, on_cpu)
        out = None
        if len(on_cpu) < len(expert_ids):  # the misses' places: a hit's id at weight 0
            self.shared.num_overlapped_calls += 1
            hit_ids, hit_weights = self._hits_only(expert_ids, routed_weights, on_cpu)
            out = gpu(ids.new_tensor(hit_ids), weights.new_tensor(hit_weights)).float()
            expert_ids = [*expert_ids, *hit_ids]  # a filler the kernels read, kept too
        self._mark(x.device)
        self._start_prefetch(moe, x_host, expert_ids, queued)
        cpu_result = future.result()
        self._observe()
        cpu_out = cpu_result.to(x.device, non_blocking=True)[None]  # [1, H]
        return (cpu_out if out is None else out + cpu_out).to(x.dtype)

    def _land(self, expert_ids: list[int]) -> None:
        """With prefetch, before the ids are split by the table: publish the copies that
        landed, score this layer's guess, and note the row this layer runs with."""
        prefetch = self.shared.prefetch
        if prefetch is None:
            return
        promotion = self.shared.promotion
        promotion.land()  # this layer's prefetched copies among them
        row = self.shared.store.table_mirror[self.layer]
        prefetch.score(self.layer, expert_ids, row)
        promotion.note_row(self.layer, row)

    def _queued(self, device: torch.device) -> torch.cuda.Event | None:
        """With prefetch on a GPU: an event after the work queued so far, before this
        layer's hits (the prefetch's copies may start there: the hits read only this
        layer's routed experts, which the prefetch never evicts)."""
        if self.shared.prefetch is None or device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def _start_prefetch(self, moe, x_host: torch.Tensor | None, read_ids: list[int],
                        queued: torch.cuda.Event | None) -> None:
        """With prefetch, once this layer's hits are queued: guess the next layer's
        experts and start their copies (host work while the GPU and the CPU compute);
        read_ids: every expert of this layer the queued kernels read (never evicted)."""
        if self.shared.prefetch is not None and x_host is not None:
            self.shared.prefetch.start(self.layer, moe, x_host, read_ids, queued,
                                       self.shared.promotion)

    def _mark(self, device: torch.device) -> None:
        """With balance: note what the GPU has queued for this layer (its hits) now."""
        if self.shared.balance:
            if self._probe is None:
                self._probe = GpuProbe(device)
            self._probe.mark()

    def _observe(self) -> None:
        """With balance, once the CPU's sum landed: move the layer's share toward the side
        that finished first."""
        if self.shared.balance and self._probe is not None:
            self.shared.balance_of(self.layer).observe(self._probe.busy())

    def _hits_only(self, expert_ids: list[int], weights: list[float], on_cpu: list[int]
                   ) -> tuple[list[int], list[float]]:
        """The GPU's ids and weights with the CPU's experts taken out: each replaced by a
        hit's id (else any expert of the layer in a slot, else itself) at weight 0."""
        hits = [e for i, e in enumerate(expert_ids) if i not in on_cpu]
        if hits:
            filler = hits[0]
        else:
            resident = (self.shared.store.table_mirror[self.layer] >= 0).nonzero()
            filler = int(resident[0, 0]) if len(resident) else -1
        return ([e if i not in on_cpu or filler < 0 else filler
                 for i, e in enumerate(expert_ids)],
                [0.0 if i in on_cpu else w for i, w in enumerate(weights)])

    # ---- the split step's phases (fast/decode_split.py) ---------------------------------

    def stage(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Device side, capturable: copy the token's ids, weights and x to the host."""
        if self._buffers is None:
            self._buffers = _SplitBuffers(ids, weights, x.shape[-1], self.shared.cache.dtype)
        b = self._buffers
        b.ids_host.copy_(ids, non_blocking=True)
        b.weights_host.copy_(weights, non_blocking=True)
        b.x_host.copy_(x[0], non_blocking=True)

    def split(self, moe) -> None:
        """Host: wait for stage's copies, choose the CPU's experts, queue the hits' ids and
        weights into the device buffers `hits` reads, and start the CPU."""
        b = self._buffers
        assert b is not None, "stage runs before split"
        started_s = time.perf_counter()
        if b.hit_ids.device.type == "cuda":
            torch.cuda.current_stream(b.hit_ids.device).synchronize()
        waited_s = time.perf_counter()
        expert_ids, routed_weights = b.ids_host.tolist(), b.weights_host.tolist()
        self._land(expert_ids)
        on_cpu = self._choose(expert_ids)
        hit_ids, hit_weights = self._hits_only(expert_ids, routed_weights, on_cpu)
        # What join's prefetch needs: the experts the hits' kernels read (a miss's filler
        # among them), and an event before they were queued.
        b.moe, b.read_ids, b.queued = moe, [*expert_ids, *hit_ids], self._queued(
            b.hit_ids.device)
        if on_cpu and len(on_cpu) < len(expert_ids):
            self.shared.num_overlapped_calls += 1
        b.hit_ids_host.copy_(torch.tensor(hit_ids, dtype=b.hit_ids_host.dtype))
        b.hit_weights_host.copy_(torch.tensor(hit_weights, dtype=torch.float32))
        b.hit_ids.copy_(b.hit_ids_host, non_blocking=True)
        b.hit_weights.copy_(b.hit_weights_host, non_blocking=True)
        b.future = (self._submit(moe, b.x_host.clone(), expert_ids, routed_weights, on_cpu)
                    if on_cpu else None)
        self._add_times("split", started_s, waited_s, waited_s, time.perf_counter())

    def _add_times(self, phase: str, started_s: float, wait_from_s: float, wait_to_s: float,
                   ended_s: float) -> None:
        """Add a split or join's host time: its wait, and the rest of it."""
        times = self.shared.host_seconds
        times[f"cpu_{phase}_wait_s"] += wait_to_s - wait_from_s
        times[f"cpu_{phase}_host_s"] += ended_s - started_s - (wait_to_s - wait_from_s)

    def hits(self, gpu: GpuExperts) -> torch.Tensor:
        """Device side, capturable: the hits by the slot-table kernels -> float32 [1, H]."""
        b = self._buffers
        assert b is not None, "stage runs before hits"
        return gpu(b.hit_ids, b.hit_weights).float()

    def join(self) -> None:
        """Host: wait for the CPU and queue its sum into the device buffer combine reads."""
        b = self._buffers
        assert b is not None, "stage runs before join"
        started_s = time.perf_counter()
        if b.future is None:
            b.cpu_out.zero_()
            self._start_prefetch(b.moe, b.x_host, b.read_ids, b.queued)
            self._add_times("join", started_s, started_s, started_s, time.perf_counter())
            return
        self._mark(b.cpu_out.device)  # after the hits' kernels, queued before the join
        self._start_prefetch(b.moe, b.x_host, b.read_ids, b.queued)
        waiting_s = time.perf_counter()
        result = b.future.result()
        waited_s = time.perf_counter()
        b.out_host.copy_(result)
        self._observe()
        b.future = None
        b.cpu_out.copy_(b.out_host, non_blocking=True)
        self._add_times("join", started_s, waiting_s, waited_s, time.perf_counter())

    def combine(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Device side, capturable: the hits' [1, H] plus the CPU's sum, in dtype."""
        b = self._buffers
        assert b is not None, "stage runs before combine"
        return (out + b.cpu_out[None]).to(dtype)
