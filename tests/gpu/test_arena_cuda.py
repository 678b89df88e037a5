"""Arenas on CUDA virtual memory, checked against what NVML and the GPU really do.

Run with `python -m pytest tests/gpu/test_arena_cuda.py -q -s` to see the printed bandwidths.
Needs about 5 GiB of free VRAM and 8 GiB of RAM; skipped without CUDA.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from gpu_helpers import GIB, MIB, captured, nvml_used_bytes, wait_for_free_vram

from strata.engine.core.memory.arena import Arena, ArenaMapError, ArenaReleasedError
from strata.engine.core.memory.expert_store import ExpertStore
from strata.engine.core.memory.host_copy import HostCopy
from strata.engine.core.memory.vram import gpu_processes, read_free_vram_bytes

pytestmark = pytest.mark.gpu

CHUNK_BYTES = 512 * MIB


def _filled_arena(backend, name: str, size_bytes: int, seed: int) -> Arena:
    arena = Arena(name, size_bytes, backend, chunk_bytes=CHUNK_BYTES)
    arena.map()
    generator = torch.Generator(device=backend.device).manual_seed(seed)
    arena.tensor(0, (size_bytes // 8,), torch.int64).random_(generator=generator)
    torch.cuda.synchronize()
    return arena


def test_release_frees_vram_and_refill_brings_the_content_back(cuda_backend):
    size = 4 * GIB
    arena = _filled_arena(cuda_backend, "experts", size, seed=1)
    host = HostCopy.snapshot(arena)
    print(f"\nhost copy of {size / GIB:.0f} GiB: {host.pin_note}")
    address = arena.tensor(0, (16,), torch.uint8).data_ptr()

    used_mapped = nvml_used_bytes()
    t0 = time.perf_counter()
    assert arena.release() == size
    release_s = time.perf_counter() - t0
    used_released = nvml_used_bytes()
    drop = used_mapped - used_released
    assert drop >= 0.9 * size, (
        f"NVML used VRAM fell by only {drop / MIB:.0f} MiB after releasing a {size / MIB:.0f} "
        "MiB arena: cuMemUnmap/cuMemRelease did not give the memory back"
    )
    with pytest.raises(ArenaReleasedError, match="refill it before use"):
        arena.tensor(0, (16,), torch.uint8)

    result = arena.refill()
    rise = nvml_used_bytes() - used_released
    assert rise >= 0.9 * size, f"NVML used VRAM rose by only {rise / MIB:.0f} MiB on refill"
    assert arena.tensor(0, (16,), torch.uint8).data_ptr() == address, "the arena moved"
    assert host.count_differing_chunks(arena) == 0, "refilled content differs from the host copy"
    print(
        f"release {size / GIB:.0f} GiB: {release_s * 1e3:.1f} ms; refill: map "
        f"{result.map_s * 1e3:.1f} ms + copy {result.copy_s * 1e3:.0f} ms = "
        f"{size / (result.map_s + result.copy_s) / 1e9:.1f} GB/s"
    )
    arena.close()
    host.close()


def test_cuda_graph_gives_identical_results_after_release_and_refill(cuda_backend):
    device = cuda_backend.device
    arena = Arena("weights", 64 * MIB, cuda_backend, chunk_bytes=32 * MIB)
    arena.map()
    w = arena.allocate((1024, 1024), torch.float32)
    x = arena.allocate((64, 1024), torch.float32)
    out = arena.allocate((64, 1024), torch.float32)
    generator = torch.Generator(device=device).manual_seed(0)
    w.copy_(torch.randn(1024, 1024, device=device, generator=generator))
    x.copy_(torch.randn(64, 1024, device=device, generator=generator))
    host = HostCopy.snapshot(arena)

    graph, _ = captured(lambda: torch.matmul(x, w, out=out).relu_())
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    expected = out.clone()
    assert torch.allclose(expected, torch.relu(x @ w), rtol=1e-3, atol=1e-3), "graph is wrong"

    arena.release()
    arena.refill()
    out.zero_()  # so only the replay can put the result back
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected), "the graph replayed over the refilled arena differs"
    del graph
    arena.close()
    host.close()


# Holds all free VRAM but leave_bytes until its stdin closes, like a game or ComfyUI would.
_HOLDER = textwrap.dedent("""
    import sys, torch
    leave_bytes = int(sys.argv[1])
    torch.empty(1, device="cuda")
    free_bytes, _ = torch.cuda.mem_get_info()
    want, held = free_bytes - leave_bytes, None
    while want > 0 and held is None:
        try:
            held = torch.empty(want, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            want -= 256 << 20
    print("READY", 0 if held is None else held.numel(), flush=True)
    sys.stdin.read()
""")


def test_refill_fails_cleanly_while_another_process_holds_the_memory(cuda_backend):
    size = 2 * GIB
    arena = _filled_arena(cuda_backend, "experts", size, seed=2)
    host = HostCopy.snapshot(arena)
    arena.release()
    torch.cuda.empty_cache()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(size // 2)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = holder.stdout.readline()
        assert line.startswith("READY"), f"the VRAM-holding subprocess failed to start: {line!r}"
        free_before = read_free_vram_bytes(0)
        assert free_before is not None and free_before < size, (
            f"the holder left {free_before} bytes free; the test needs less than the arena"
        )
        with pytest.raises(ArenaMapError) as failure:
            arena.refill()
        print(f"\nrefill refused as expected: {failure.value}")
        assert failure.value.missing_bytes > 0
        assert arena.state == "released" and arena.resident_bytes == 0
        free_after = read_free_vram_bytes(0)
        assert abs(free_after - free_before) < 64 * MIB, (
            f"free VRAM went {free_before / MIB:.0f} -> {free_after / MIB:.0f} MiB: the "
            "failed refill did not unmap what it had mapped"
        )
        ones = torch.ones(256, 256, device=cuda_backend.device)
        assert float((ones @ ones).sum()) == 256.0**3, (
            "the CUDA context is broken after the failure"
        )
        torch.cuda.synchronize()
    finally:
        holder.stdin.close()  # its read() returns and it exits, freeing the memory
        holder.wait(timeout=60)
    free = wait_for_free_vram(size + 256 * MIB)
    assert free >= size, f"only {free / MIB:.0f} MiB free after the holder exited"
    arena.refill()
    assert host.count_differing_chunks(arena) == 0
    arena.close()
    host.close()


def test_partial_mapping_keeps_the_head_and_frees_the_tail(cuda_backend):
    arena = Arena("kv", GIB, cuda_backend, chunk_bytes=64 * MIB)
    assert arena.ensure_mapped(100 * MIB) == 128 * MIB and arena.state == "partial"
    keys = arena.allocate((GIB // 2,), torch.float16, require_mapped=False)
    keys[: 50 * MIB].fill_(1.5)
    arena.ensure_mapped(600 * MIB)
    used = nvml_used_bytes()
    assert arena.release_from(100 * MIB) == 512 * MIB
    assert used - nvml_used_bytes() >= 0.9 * 512 * MIB
    assert bool((keys[: 50 * MIB] == 1.5).all()), "the mapped head lost its content"
    with pytest.raises(ArenaReleasedError, match="not mapped"):
        arena.check_mapped(0, 200 * MIB)
    arena.close()


def test_host_copy_bandwidth_is_reported(cuda_backend):
    size = 2 * GIB
    arena = Arena("bandwidth", size, cuda_backend, chunk_bytes=CHUNK_BYTES)
    arena.map()
    host = HostCopy(size)
    torch.arange(size // 4, dtype=torch.int32, out=host.tensor(0, (size // 4,), torch.int32))
    back = HostCopy(size)
    assert host.pin(0) and back.pin(0), f"pinning failed: {host.pin_note} / {back.pin_note}"
    to_device = host.copy_to(arena)
    to_host = back.copy_from(arena)
    assert torch.equal(back.tensor(0, (size,), torch.uint8), host.tensor(0, (size,), torch.uint8))
    print(
        f"\nHostCopy pinned: host->device {to_device.gb_per_s:.1f} GB/s, "
        f"device->host {to_host.gb_per_s:.1f} GB/s ({size / GIB:.0f} GiB)"
    )
    arena.close()
    host.close()
    back.close()


def test_expert_store_fetch_release_refill(cuda_backend, monkeypatch):
    generator = torch.Generator().manual_seed(3)
    layers = {
        layer: tuple(
            torch.randn(16, *shape, generator=generator).to(torch.bfloat16)
            for shape in ((256, 128), (256, 128), (128, 256))
        )
        for layer in range(2)
    }
    store = ExpertStore(layers, num_slots=12, backend=cuda_backend)
    gate, _, down = store.fetch(1, torch.tensor([9, 4], device=cuda_backend.device))
    assert torch.equal(gate.cpu(), layers[1][0][[9, 4]]) and torch.equal(
        down.cpu(), layers[1][2][[9, 4]]
    )
    store.release()
    with pytest.raises(ArenaReleasedError):
        store.fetch(1, [9])
    monkeypatch.setenv("STRATA_VERIFY_REFILL", "1")
    assert store.refill().differing_slots == 0
    gate, _, _ = store.fetch(0, [15, 0])
    assert torch.equal(gate.cpu(), layers[0][0][[15, 0]])
    store.close()


def test_nvml_reports_free_vram_and_processes(cuda_backend):
    free_bytes = read_free_vram_bytes(0)
    assert free_bytes is not None and free_bytes > 0
    processes = gpu_processes(0)
    print(f"\nfree {free_bytes / GIB:.1f} GiB; processes: {processes}")
    # NVML reports host PIDs; inside a PID namespace ours may not match, so only the shape.
    assert all(p.pid > 0 and p.name for p in processes)
    if os.environ.get("STRATA_EXPECT_OWN_PID") == "1":
        assert os.getpid() in {p.pid for p in processes}
