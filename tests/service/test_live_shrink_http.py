"""POST /cache/shrink on a MoE whose experts all fit (wired into the model at load), served by
the real engine process (the real Engine on a tiny Qwen3-MoE, CPU): it switches to the partial
cache while serving instead of answering 400 not_applicable, answers the same tokens after,
and grows back (issue 54)."""

from __future__ import annotations

import aiohttp
import pytest
from fakes.tiny_model import write_tiny_model_dir

from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from strata.units import MIB
from tests.helpers.serving import serving
from tests.helpers.tiny_models import make_tiny_hf_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PROMPT = " ".join(f"w{(i * 7) % 300 + 10}" for i in range(12))
TOTAL_MIB = 4000


async def post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url, json=body) as response:
        return response.status, await response.json()


async def test_shrink_switches_an_all_resident_moe_live_and_it_keeps_answering(tmp_path):
    model_dir, _ = make_tiny_hf_model("qwen3_moe", tmp_path / "moe")
    write_tiny_model_dir(model_dir, vocab_size=320)
    settings = ServeSettings(model=str(model_dir), port=0, device="cpu", context_tokens=256,
                             snapshot_ram_budget_bytes=0,
                             snapshot_dir=str(tmp_path / "snapshots"))
    box: dict = {}

    def free_bytes() -> int:  # a GPU of TOTAL_MIB where another program holds `other`
        status = box["service"].status()
        held = sum(a["resident_bytes"] for a in status["vram"].values())
        return TOTAL_MIB * MIB - held - box.get("other", 0)

    service = box["service"] = Service(settings, vram_reader=free_bytes)
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 8}
    async with serving(settings, service) as base, aiohttp.ClientSession() as session:
        status, before = await post(session, f"{base}/v1/completions", body)
        assert status == 200, before
        experts = service.status()["experts"]
        assert experts["mode"] == "all" and experts["num_slots"] == experts["max_slots"]
        box["other"] = free_bytes()  # nothing left free: shrink as far as it goes
        status, shrunk = await post(session, f"{base}/cache/shrink", {"keep_free_mib": 1})
        assert status == 200, shrunk
        experts = service.status()["experts"]
        assert experts["mode"] == "slots" and experts["num_slots"] < experts["max_slots"]
        assert shrunk["num_slots"] == experts["num_slots"]
        status, after = await post(session, f"{base}/v1/completions", body)
        assert status == 200, after
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        box["other"] = 0
        status, grown = await post(session, f"{base}/cache/refill", {})
        assert status == 200, grown
        experts = service.status()["experts"]
        assert experts["num_slots"] == experts["max_slots"] and experts["mode"] == "slots"
        status, again = await post(session, f"{base}/v1/completions", body)
        assert again["choices"][0]["text"] == before["choices"][0]["text"]
