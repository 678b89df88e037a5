"""The game scenario on a real GPU (bench/game_scenario.py, smaller): for each action a rule gives
the VRAM back to a "game" process that needs it, requests meanwhile get a clean 503 with Retry-After
(or, with shrink_experts, an answer from the partial cache), the model comes back when the game
exits, and the follow-up turn reuses the conversation's cache. Times are recorded by the bench, not
asserted here."""

from __future__ import annotations

import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from game_scenario import run, table

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


async def test_every_action_gives_the_vram_to_the_game_and_comes_back_with_the_cache():
    args = Namespace(layers=4, prompt_tokens=4096, hold_s=1.5, vram_wait_s=0.5,
                     game_api="cuda", actions=["shrink_experts", "release_experts",
                                               "offload_session", "sleep", "unload"],
                     cpu_dry_run=False, trigger="process")
    report = await run(args)
    print(table(report))  # the figures for docs/benchmarks.md (pytest -s)
    rows = {row["action"]: row for row in report["rows"]}
    for action, row in rows.items():
        assert row["game_ok"] and row["game_exit_code"] == 0, (action, row)  # it got its VRAM
        assert row["release_s"] is not None, (action, row)  # NVML saw the engine let go
        assert row["back_s"] is not None, (action, row)
        assert row["followup_answer"] == "tokens", (action, row)
        # The conversation's history is reused: prompt and answer, at every level.
        assert row["followup_cached_tokens"] >= row["cold_prompt_tokens"], (action, row)
    for action in ("release_experts", "sleep", "unload"):
        during = rows[action]["request_during"]
        assert during["answer"] == "503 insufficient_vram" and during["retry_after_s"], during
    # Shrunk, the model keeps answering while the game holds its memory.
    assert rows["shrink_experts"]["request_during"]["answer"] == "tokens"
