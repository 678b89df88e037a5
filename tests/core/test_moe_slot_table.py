"""The grouped MoE kernels with a slot table (a partial expert cache): every routed expert is
read from its slot when the table has one, else in place from the host copy; one kernel."""

from __future__ import annotations

import os

import pytest
import torch

# Must precede the first Triton import: triton.jit picks the interpreter at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton CPU interpreter not enabled"
)

from strata.engine.core.fast import moe_triton

E, INTER, HIDDEN, TOP_K, NUM_SLOTS = 6, 24, 40, 3, 4


def _experts(seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, INTER, HIDDEN, generator=g), torch.randn(E, INTER, HIDDEN, generator=g),
            torch.randn(E, HIDDEN, INTER, generator=g))


def _reference(x, experts, ids, weights):
    gate, up, down = experts
    out = torch.zeros(HIDDEN)
    for j, e in enumerate(ids.tolist()):
        act = torch.nn.functional.silu(gate[e] @ x) * (up[e] @ x)
        out += weights[j] * (down[e] @ act)
    return out


def _offsets(host, slots):
    """Elements from each slot weight's base to the host copy's [E, ...] tensor."""
    return tuple((h.data_ptr() - s.data_ptr()) // h.element_size() for h, s in zip(host, slots))


@pytest.mark.parametrize("resident", [(), (0, 2), (0, 2, 5), (0, 1, 2, 5)],
                         ids=["all-host", "some", "all-routed-resident", "full"])
def test_table_reads_slots_and_host_like_the_reference(resident) -> None:
    host = _experts(0)
    ids = torch.tensor([5, 0, 2])
    weights = torch.tensor([0.5, 0.3, 0.2])
    x = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(1))
    # Slots hold the resident experts in a shuffled order; other slots hold garbage, so a
    # wrong slot or a resident expert read from the host would change the result... and a
    # host expert read from a slot too: the garbage differs from every expert.
    slots = tuple(torch.full((NUM_SLOTS, *w.shape[1:]), 7.0) for w in host)
    table = torch.full((E,), -1, dtype=torch.int32)
    for slot, expert in zip((3, 1, 0, 2), resident):
        table[expert] = slot
        for s, h in zip(slots, host):
            s[slot] = h[expert]
    offsets = _offsets(host, slots)
    act = moe_triton.grouped_gate_up(x, slots[0], slots[1], ids, table, offsets[:2])
    got = moe_triton.grouped_down_sum(act, slots[2], ids, weights, table, offsets[2])
    torch.testing.assert_close(got, _reference(x, host, ids, weights), rtol=1e-5, atol=1e-4)
    # The same kernels without a table read the stacked weights by expert id.
    act = moe_triton.grouped_gate_up(x, host[0], host[1], ids)
    plain = moe_triton.grouped_down_sum(act, host[2], ids, weights)
    torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-5)


def test_a_stale_slot_is_what_the_kernel_reads() -> None:
    """The table, not the expert id, picks the rows: pointing it at a wrong slot changes the
    result (so the parity above cannot pass by reading the host copy for everyone)."""
    host = _experts(2)
    ids = torch.tensor([1])
    x = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(3))
    slots = tuple(torch.zeros(NUM_SLOTS, *w.shape[1:]) for w in host)
    table = torch.full((E,), -1, dtype=torch.int32)
    offsets = _offsets(host, slots)
    from_host = moe_triton.grouped_gate_up(x, slots[0], slots[1], ids, table, offsets[:2])
    table[1] = 2  # slot 2 holds zeros
    from_slot = moe_triton.grouped_gate_up(x, slots[0], slots[1], ids, table, offsets[:2])
    assert from_host.abs().sum() > 0 and torch.equal(from_slot, torch.zeros_like(from_slot))


def test_bad_tables_get_clear_errors() -> None:
    host = _experts(4)
    ids, x = torch.tensor([0]), torch.randn(HIDDEN)
    with pytest.raises(ValueError, match="contiguous int32"):
        moe_triton.grouped_gate_up(x, host[0], host[1], ids, torch.zeros(E), (0, 0))
    with pytest.raises(ValueError, match="2 host offsets"):
        moe_triton.grouped_gate_up(x, host[0], host[1], ids, torch.zeros(E, dtype=torch.int32),
                                   (0,))
    with pytest.raises(ValueError, match="out_ids"):
        moe_triton.router_topk(x, torch.randn(E, HIDDEN), TOP_K, True,
                               out_ids=torch.zeros(TOP_K, dtype=torch.int32))
    router = torch.randn(E, HIDDEN)
    out_ids = torch.zeros(TOP_K, dtype=torch.long)
    _, ids = moe_triton.router_topk(x, router, TOP_K, True, out_ids=out_ids)
    assert ids.data_ptr() == out_ids.data_ptr()
    assert out_ids.tolist() == torch.topk(router @ x, TOP_K).indices.tolist()
