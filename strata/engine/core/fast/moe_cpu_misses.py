"""A partial expert cache's misses computed on the CPU during one-token decode (issue 54).

A miss read in place over PCIe costs ~300 us an expert where small reads run ~10 GB/s
(2.86 MB of Qwen3-30B-A3B Q4_K_M), where llama.cpp computes one on 16 CPU threads in ~57 us.
With `cpu_expert_misses` on, a one-token MoE layer over the slot table:

1. routes on the GPU as before (the router leaves the ids in step_ids for promotion);
2. copies ids, weights and x to the host (a sync: this runs eagerly, never in a graph) and
   splits the ids by the host mirror of the slot table, which the device table equals for
   the kernels queued now (the promotion publishes both at once, ExpertStore.update_table);
3. hands the misses to a worker thread, which computes them from the CPU forms of the
   host copy (memory/cpu_expert_cache.py, quant/cpu_experts.py);
4. meanwhile queues the GPU's expert kernels unchanged for the hits, the misses replaced
   by a hit's id with weight 0 (a second read of a slot, from VRAM), or none when all missed;
5. adds the CPU's [H] sum, copied to the device, to the GPU's.

"on" computes every miss on the CPU (converting a missed expert on first use: 19-43 ms);
"auto" computes those whose CPU form is kept and reads the rest over PCIe as before, their
conversion queued on a second worker for the next time. Under CUDA graph capture (a batch
graph's row) the layer reads its misses in place as before: the graphs never see this path
(docs/architecture.md says how a graph could hold it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from strata.engine.core.engine_config import check_cpu_expert_misses
from strata.engine.core.memory.cpu_expert_cache import CpuExpertCache
from strata.engine.core.memory.expert_store import ExpertStore
from strata.engine.core.quant.cpu_experts import HostEpilogue, routed_ffn

GpuExperts = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, weights) -> [1, H]


class CpuMisses:
    """The CPU half of a partial cache's one-token decode: the CPU forms, the workers, and
    each MoE layer's view (`for_layer`, which SlotLayout carries)."""

    def __init__(self, store: ExpertStore, mode: str, limit_bytes: int,
                 model_dtype: torch.dtype):
        if check_cpu_expert_misses(mode) == "off":
            raise ValueError("CpuMisses is for cpu_expert_misses on or auto")
        self.store = store
        self.mode = mode
        self.cache = CpuExpertCache(store, limit_bytes, model_dtype)
        self._compute = ThreadPoolExecutor(1, thread_name_prefix="cpu-experts")
        self._convert = ThreadPoolExecutor(1, thread_name_prefix="cpu-expert-forms")
        self._lock = threading.Lock()  # the conversions queued
        self._converting: set[tuple[int, int]] = set()
        self._epilogues: dict[int, HostEpilogue | None] = {}
        # One-token MoE layers split on the host, and those of them whose hits the GPU
        # computed while the CPU computed their misses.
        self.num_layer_calls = 0
        self.num_overlapped_calls = 0

    def for_layer(self, layer: int) -> LayerCpuMisses:
        """Layer's view, for its SlotLayout."""
        return LayerCpuMisses(self, layer)

    def is_kept(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.cache

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

    def wait_converted(self) -> None:
        """Block until the queued conversions are done (tests, benchmarks' warm-up)."""
        self._convert.submit(lambda: None).result()

    def status(self) -> dict:
        """The CPU forms' cache and the mode, as plain values."""
        return {"cpu_expert_misses": self.mode, "num_cpu_split_layers": self.num_layer_calls,
                "num_cpu_overlapped_layers": self.num_overlapped_calls, **self.cache.status()}

    def close(self) -> None:
        """Stop the workers (queued conversions are dropped) and drop the CPU forms."""
        self._convert.shutdown(wait=True, cancel_futures=True)
        self._compute.shutdown(wait=True)
        self.cache.clear()


class LayerCpuMisses:
    """One MoE layer's CPU-computed misses (SlotLayout.cpu_misses)."""

    def __init__(self, shared: CpuMisses, layer: int):
        self.shared = shared
        self.layer = layer

    def routed(self, moe, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               gpu: GpuExperts) -> torch.Tensor:
        """One token's routed experts, x [1, H], ids and weights [k] on the device -> [1, H]:
        hits by `gpu` (the slot-table kernels), misses on the CPU, both at once."""
        if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return gpu(ids, weights)  # a graph cannot wait for the host: misses in place
        shared, store = self.shared, self.shared.store
        expert_ids = ids.tolist()  # the sync: the host decides which experts it computes
        table = store.table_mirror[self.layer]
        missed = [i for i, e in enumerate(expert_ids) if int(table[e]) < 0]
        if shared.mode == "auto":
            kept = [i for i in missed if shared.is_kept(self.layer, expert_ids[i])]
            for i in missed:
                if i not in kept:
                    shared.convert_later(self.layer, expert_ids[i])
            missed = kept
        shared.num_layer_calls += 1
        if not missed:
            return gpu(ids, weights)
        routed_weights = weights.float().tolist()
        x_host = x[0].to("cpu", shared.cache.dtype)
        cpu_ids = [expert_ids[i] for i in missed]
        future = shared.submit(self.layer, x_host, cpu_ids, [routed_weights[i] for i in missed],
                               shared.epilogue(self.layer, moe))
        store.note_cpu_experts(self.layer, len(missed))
        hits = [i for i in range(len(expert_ids)) if i not in missed]
        out = None
        if hits:  # the misses' places: a hit's id at weight 0 (its slot read again)
            shared.num_overlapped_calls += 1
            filler = expert_ids[hits[0]]
            gpu_ids = [filler if i in missed else e for i, e in enumerate(expert_ids)]
            gpu_weights = [0.0 if i in missed else w for i, w in enumerate(routed_weights)]
            out = gpu(ids.new_tensor(gpu_ids), weights.new_tensor(gpu_weights)).float()
        cpu_out = future.result().to(x.device, non_blocking=True)[None]  # [1, H]
        return (cpu_out if out is None else out + cpu_out).to(x.dtype)
