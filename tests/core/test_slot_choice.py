"""Slot choice for a request without an explicit slot: longest prefix, else LRU (empty first)."""

from __future__ import annotations

import pytest

from strata.engine.core.batch.slot_choice import IdleSlot, choose_slot, reuse_threshold

PROMPT = list(range(100))


def idle(slot: int, tokens, last_used_s: float = 1.0) -> IdleSlot:
    return IdleSlot(slot, tokens, len(tokens), last_used_s)


def test_the_longest_shared_prefix_wins() -> None:
    slots = [idle(0, PROMPT[:60], 5.0), idle(1, [*PROMPT[:90], 7], 1.0), idle(2, [], 0.0)]
    assert choose_slot(PROMPT, slots) == 1


def test_a_prefix_under_the_threshold_goes_to_an_empty_slot_then_the_lru_one() -> None:
    assert reuse_threshold(100) == 50 and reuse_threshold(10) == 16
    short_prefix = [*PROMPT[:49], 999]
    assert choose_slot(PROMPT, [idle(0, short_prefix, 1.0), idle(3, [], 0.0)]) == 3
    assert choose_slot(PROMPT, [idle(0, short_prefix, 9.0), idle(2, [5, 6], 3.0)]) == 2


def test_a_slot_a_waiting_request_asked_for_is_left_to_it() -> None:
    slots = [idle(0, PROMPT[:80], 1.0), idle(1, [], 0.0)]
    assert choose_slot(PROMPT, slots, avoid=frozenset({0})) == 1
    assert choose_slot(PROMPT, [idle(0, [], 0.0)], avoid=frozenset({0})) == 0  # nothing else


def test_a_stored_snapshot_of_unknown_ids_is_not_treated_as_empty() -> None:
    unknown = IdleSlot(0, (), 500, 0.0)  # another run's file: ids unread
    assert choose_slot(PROMPT, [unknown, idle(1, [1], 2.0)]) == 0  # older, still LRU
    assert choose_slot(PROMPT, [unknown, idle(1, [], 0.0)]) == 1  # the empty one first


def test_no_idle_slot_is_a_bug() -> None:
    with pytest.raises(ValueError):
        choose_slot(PROMPT, [])
