"""Slots on a CUDA device: bf16 KV goes to host RAM or disk and comes back bit for bit.

In bf16 the same tokens round differently when decode steps computed their K/V (a warm slot)
than when one prefill did (a cold run), so greedy output can flip at a near tie between the
two (a top-2 gap under bf16's step of ~0.03 at logit 5). What a restore must guarantee is that
it changes nothing: the K/V come back bit for bit and the next answer equals the answer of a
slot that took the same path and was never offloaded. The CPU tests check cold equality in
float32, where it holds.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.snapshots.helpers import (
    SLOT_KV_BYTES,
    locations,
    make_engine,
    run,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none here"),
]


def test_switching_slots_on_cuda_restores_identical_kv(model_dir, tmp_path) -> None:
    # bf16 halves the float32 figure: the budget holds exactly one slot.
    engine = make_engine(model_dir, tmp_path, device="cuda", kv_budget_bytes=SLOT_KV_BYTES // 2)
    assert engine.slots_status()[0]["location"] == "empty"
    rng = random.Random(40)
    prompt = [rng.randrange(320) for _ in range(700)]
    answer = run(engine, prompt, slot=0)
    before = [t.clone() for t in engine.slots.resident[0].state]
    kv_resident_with_one_slot = engine.status()["arenas"]["kv"]["resident_bytes"]
    assert before[0].dtype == torch.bfloat16 and before[0].is_cuda
    run(engine, prompt[:100], slot=1)  # evicts slot 0 to a host snapshot
    assert locations(engine)[0] == "ram"
    # Slot 0's KV pages went back before slot 1's were mapped: the kv arena (not torch's
    # allocator, which also holds graph pools and cuBLAS workspaces) never holds two slots.
    assert engine.status()["arenas"]["kv"]["resident_bytes"] <= kv_resident_with_one_slot
    follow = prompt + answer + [5, 6, 7]
    warm = run(engine, follow, slot=0)
    assert engine.last_usage.cached_tokens == len(prompt) + len(answer) - 1
    after = engine.slots.resident[0].state[: len(before)]
    assert all(torch.equal(a[: b.shape[0]], b) for a, b in zip(after, before, strict=True))
    run(engine, prompt, slot=2)  # the same path, never evicted
    assert run(engine, follow, slot=2) == warm


def test_persisted_bf16_snapshot_survives_a_restart_on_cuda(model_dir, tmp_path) -> None:
    rng = random.Random(41)
    prompt = [rng.randrange(320) for _ in range(500)]
    reference = make_engine(model_dir, tmp_path / "reference", device="cuda")
    first = make_engine(model_dir, tmp_path, device="cuda", persist_sessions=True)
    answer = run(first, prompt, slot=1)
    assert run(reference, prompt, slot=1) == answer
    before = [t.clone() for t in first.slots.resident[1].state]
    first.offload_session()
    first.close()
    second = make_engine(model_dir, tmp_path, device="cuda", persist_sessions=True)
    assert locations(second)[1] == "disk"
    follow = prompt + answer + [rng.randrange(320) for _ in range(200)]
    got = run(second, follow, slot=1)
    assert second.slots.last_restore["source"] == "disk"
    assert second.last_usage.cached_tokens == len(prompt) + len(answer) - 1
    after = second.slots.resident[1].state
    assert all(torch.equal(a[: b.shape[0]], b) for a, b in zip(after, before, strict=True))
    assert got == run(reference, follow, slot=1)
