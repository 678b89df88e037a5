"""Engine slots end to end on a tiny llama: switching under a KV budget, offload, restart."""

from __future__ import annotations

import gc
import os
import random

import psutil
import pytest

from strata.engine.core.snapshots import SnapshotInvalid, SnapshotNameError
from tests.snapshots.helpers import (
    GREEDY,
    KV_BYTES_PER_TOKEN,
    SLOT_KV_BYTES,
    Conversation,
    locations,
    make_engine,
    random_tokens,
    run,
)


def test_alternating_conversations_under_a_one_slot_budget(model_dir, cold, tmp_path) -> None:
    engine = make_engine(model_dir, tmp_path, kv_budget_bytes=SLOT_KV_BYTES * 3 // 2)
    chats = [Conversation(0, seed=1, turn_tokens=700), Conversation(1, seed=2, turn_tokens=650)]
    answers: list[list[int] | None] = [None, None]
    for _ in range(4):
        for i, chat in enumerate(chats):
            answers[i] = chat.turn(engine, cold, answers[i])
            other = chats[1 - i].slot
            # Only the active slot fits the budget; the other waits as a RAM snapshot.
            assert locations(engine)[chat.slot] == "cpu"
            if chats[1 - i].num_computed:
                assert locations(engine)[other] == "ram"
                assert engine.slots.last_restore["source"] in (None, "ram")
    assert chats[0].num_computed > 2500 and chats[1].num_computed > 2500
    # Slot 0 waits as a snapshot of only its used tokens; slot 1 holds the full-context buffers.
    waiting, active = engine.slots_status()[0], engine.slots_status()[1]
    assert (waiting["location"], waiting["n_tokens"]) == ("ram", chats[0].num_computed)
    assert waiting["bytes"] == chats[0].num_computed * KV_BYTES_PER_TOKEN
    assert (active["n_tokens"], active["bytes"]) == (chats[1].num_computed, SLOT_KV_BYTES)


def test_without_a_budget_switching_keeps_every_slot_resident(model_dir, cold, tmp_path) -> None:
    engine = make_engine(model_dir, tmp_path)
    a, b = Conversation(0, 3, 200), Conversation(2, 4, 200)
    answer_a = a.turn(engine, cold, None)
    b.turn(engine, cold, None)
    a.turn(engine, cold, answer_a)
    assert locations(engine) == {0: "cpu", 1: "empty", 2: "cpu", 3: "empty"}


def test_offload_then_request_restores_from_ram(model_dir, cold, tmp_path) -> None:
    engine = make_engine(model_dir, tmp_path)
    chat = Conversation(0, 5, 900)
    answer = chat.turn(engine, cold, None)
    result = engine.offload_session()
    assert result["offloaded_slots"] == [0] and result["locations"] == {0: "ram"}
    assert result["released_bytes"] == SLOT_KV_BYTES
    assert engine.slots.resident_bytes == 0
    num_saved = chat.num_computed
    chat.turn(engine, cold, answer)
    assert engine.slots.last_restore["source"] == "ram"
    assert engine.slots.last_restore["n_restored"] == num_saved
    assert locations(engine)[0] == "cpu"


def test_offload_spills_to_anonymous_disk_files_past_the_ram_budget(model_dir, cold, tmp_path) -> None:
    engine = make_engine(model_dir, tmp_path, snapshot_ram_budget_bytes=0)
    chat = Conversation(1, 6, 500)
    answer = chat.turn(engine, cold, None)
    assert engine.offload_session()["locations"] == {1: "disk"}
    assert os.listdir(tmp_path) == []  # delete-on-close temp files have no name
    chat.turn(engine, cold, answer)
    assert engine.slots.last_restore["source"] == "disk"


@pytest.mark.parametrize("close", ["close", "close_for_exit"])
def test_persisted_snapshots_survive_a_restart(model_dir, cold, tmp_path, close) -> None:
    first = make_engine(model_dir, tmp_path, persist_sessions=True)
    chat = Conversation(2, 7, 800)
    answer = chat.turn(first, cold, None)
    first.offload_session()
    getattr(first, close)()  # the process ends; RAM snapshots are written to files first
    assert len(list(tmp_path.glob("slot2-*.stkv"))) == 1
    second = make_engine(model_dir, tmp_path, persist_sessions=True)
    assert locations(second)[2] == "disk"
    chat.turn(second, cold, answer)
    assert second.slots.last_restore["source"] == "disk"


def anonymous_rss_bytes() -> int:
    """Resident memory minus file-backed pages (Linux `shared`): library pages that the kernel
    drops or faults back in under a busy machine's memory pressure do not blur the figure."""
    info = psutil.Process().memory_info()
    return info.rss - getattr(info, "shared", 0)


def test_rss_falls_after_offload(model_dir, tmp_path) -> None:
    from strata.engine.core.memory import os_pages

    if not os_pages.reserve(os_pages.PAGE_SIZE_BYTES).releases_pages:
        pytest.skip("Windows emulation: neither madvise nor VirtualFree here, and the portable "
                    "fallback only zero-fills (tests/memory/test_os_pages.py covers VirtualFree)")
    # 40 MiB per layer buffer: above glibc's largest mmap threshold, so a free really unmaps.
    context_tokens = 40 * 2**20 // (KV_BYTES_PER_TOKEN // 4)
    engine = make_engine(model_dir, tmp_path, context_tokens=context_tokens)
    prompt = random_tokens(random.Random(8), 300)
    first = run(engine, prompt, slot=0)
    assert engine.slots_status()[0]["bytes"] == 160 * 2**20  # the slot's reserved capacity
    # Only the pages the 300+ tokens use are mapped (DESIGN §5); those are what must go back.
    kv_bytes = engine.status()["arenas"]["kv"]["resident_bytes"]
    assert 8 * 2**20 <= kv_bytes < 160 * 2**20
    gc.collect()
    rss_before = anonymous_rss_bytes()
    engine.offload_session()
    gc.collect()
    rss_after = anonymous_rss_bytes()
    assert rss_before - rss_after > 0.8 * kv_bytes, (rss_before / 2**20, rss_after / 2**20)
    again = run(engine, prompt + first + [1, 2], slot=0)
    assert engine.last_usage.cached_tokens == len(prompt) + len(first) - 1
    assert len(again) == GREEDY.max_tokens


def test_cancel_mid_stream_leaves_the_slot_consistent(model_dir, cold, tmp_path) -> None:
    engine = make_engine(model_dir, tmp_path, kv_budget_bytes=SLOT_KV_BYTES)
    prompt = random_tokens(random.Random(9), 400)
    stream = engine.generate(prompt, GREEDY, slot=0)
    got = [next(stream)[0] for _ in range(3)]
    stream.close()
    assert engine.last_usage.finish_reason == "cancelled"
    run(engine, random_tokens(random.Random(10), 50), slot=1)  # evicts slot 0 to a snapshot
    assert locations(engine)[0] == "ram"
    follow = prompt + got + [7, 8, 9]
    assert run(engine, follow, slot=0) == cold(follow)
    # K/V of the prompt and of every token fed back before the cancel.
    assert engine.last_usage.cached_tokens == len(prompt) + len(got) - 1


def test_save_restore_erase_by_file_name(model_dir, other_model_dir, cold, tmp_path) -> None:
    engine = make_engine(model_dir, tmp_path)
    chat = Conversation(0, 11, 600)
    answer = chat.turn(engine, cold, None)
    saved = engine.save_slot(0, "chat.bin")
    size = (tmp_path / "chat.bin").stat().st_size
    assert saved["id_slot"] == 0 and saved["filename"] == "chat.bin"
    assert (saved["n_saved"], saved["n_written"]) == (chat.num_computed, size)
    assert saved["timings"]["save_ms"] >= 0
    assert engine.erase_slot(0) == {"id_slot": 0, "n_erased": chat.num_computed}
    assert locations(engine)[0] == "empty"
    restored = engine.restore_slot(3, "chat.bin")
    assert (restored["n_restored"], restored["n_read"]) == (chat.num_computed, size)
    assert "restore_ms" in restored["timings"]
    chat.slot = 3
    chat.turn(engine, cold, answer)
    # Refused: no file, another model's file, and names that leave the directory.
    before = engine.slots_status()[3]
    with pytest.raises(SnapshotInvalid) as missing:
        engine.restore_slot(3, "nope.bin")
    assert missing.value.reason == "missing"
    other = make_engine(other_model_dir, tmp_path)
    run(other, [1, 2, 3], slot=0)
    other.save_slot(0, "other.bin")
    with pytest.raises(SnapshotInvalid) as foreign:
        engine.restore_slot(3, "other.bin")
    assert foreign.value.reason == "other_model"
    for name in ("../escape.bin", "/tmp/abs.bin", "sub/x.bin", "a\\b.bin", ".."):
        with pytest.raises(SnapshotNameError, match="not a plain name"):
            engine.save_slot(3, name)
    assert not (tmp_path.parent / "escape.bin").exists()
    assert engine.slots_status()[3] == before  # failed restores left the slot as it was


def test_restore_session_brings_back_the_active_slot(model_dir, cold, tmp_path) -> None:
    engine = make_engine(model_dir, tmp_path)
    older, active = Conversation(1, 12, 200), Conversation(2, 13, 200)
    older.turn(engine, cold, None)
    answer = active.turn(engine, cold, None)
    assert engine.offload_session()["offloaded_slots"] == [1, 2]  # least recently used first
    result = engine.restore_session()
    assert result["restored_slots"] == [2] and result["n_restored"] == active.num_computed
    assert locations(engine) == {0: "empty", 1: "ram", 2: "cpu", 3: "empty"}
    active.turn(engine, cold, answer)
    assert engine.restore_session() == {"restored_slots": []}
