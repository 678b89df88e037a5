"""GPU memory that comes and goes at fixed addresses: arenas, host copies, the expert cache.

Modules (import them directly; this package imports nothing, so the host process can use
`vram` and `expert_cache` without pulling in torch):

- arena.py        Arena: reserve once, map/release/refill in chunks, zero-copy tensor views
- arena_set.py    ArenaSet: every arena by name, with byte accounting for /v1/status
- backend.py      the backend protocol, backend_for(device), cuda_available()
- cuda_vmm.py     CUDA virtual memory management backend (cuda.bindings.driver)
- cpu_mmap.py     the CPU twin over OS pages (os_pages.py)
- os_pages.py     reserve/commit/decommit: mmap+madvise, VirtualAlloc on Windows, a fallback
- host_copy.py    HostCopy: host mirror of an arena, pinned once, chunked side-stream copies
- numa.py         the GPU's NUMA node, mbind of a host copy's pages to it, where pages sit
- expert_cache.py ExpertCache residency table (LRU) and size_slots for --expert-cache
- expert_store.py ExpertStore: host copy of all experts + VRAM slots, fetch on demand
- heap_trim.py    trim_heap: the C heap's free pages back to the OS when the engine goes idle
- vram.py         NVML: free VRAM and the processes holding it
"""
