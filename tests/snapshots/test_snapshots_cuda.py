"""Slots on a CUDA device: bf16 KV goes to host RAM and comes back bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from tests.snapshots.helpers import (
    SLOT_KV_BYTES,
    ColdRunner,
    Conversation,
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
    allocated_with_one_slot = torch.cuda.memory_allocated()
    assert before[0].dtype == torch.bfloat16 and before[0].is_cuda
    run(engine, prompt[:100], slot=1)  # evicts slot 0 to a host snapshot
    assert locations(engine)[0] == "ram"
    # Slot 1's buffers took the place of slot 0's: no second slot of 1 MiB on the device.
    assert torch.cuda.memory_allocated() - allocated_with_one_slot < SLOT_KV_BYTES // 4
    follow = prompt + answer + [5, 6, 7]
    warm = run(engine, follow, slot=0)
    assert engine.last_usage.cached_tokens == len(prompt) + len(answer) - 1
    after = engine.slots.resident[0].state[: len(before)]
    assert all(torch.equal(a[: b.shape[0]], b) for a, b in zip(after, before, strict=True))
    engine.erase_slot(2)
    assert run(engine, follow, slot=2) == warm and engine.last_usage.cached_tokens == 0


def test_persisted_bf16_snapshot_survives_a_restart_on_cuda(model_dir, tmp_path) -> None:
    cold = ColdRunner(make_engine(model_dir, tmp_path / "cold", device="cuda"))
    first = make_engine(model_dir, tmp_path, device="cuda", persist_sessions=True)
    chat = Conversation(1, 41, 500)
    answer = chat.turn(first, cold, None)
    first.offload_session()
    first.close()
    second = make_engine(model_dir, tmp_path, device="cuda", persist_sessions=True)
    assert locations(second)[1] == "disk"
    chat.turn(second, cold, answer)
    assert second.slots.last_restore["source"] == "disk"
