"""llama.cpp-style routes, /v1/status and the control routes."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

STATUS_ROUTES = ["/health", "/props", "/v1/models", "/metrics", "/v1/status", "/slots"]


async def test_status_routes_never_call_generate_or_control(client, service):
    for state in ("loaded", "sleeping", "unloaded"):
        service.state = state
        for path in STATUS_ROUTES:
            resp = await client.get(path)
            assert resp.status == 200, path
    assert service.calls == []


async def test_health_reflects_the_state(client, service):
    assert await (await client.get("/health")).json() == {"status": "ok", "state": "loaded",
                                                          "ram_mib": 0.0}
    service.state = "loading"
    resp = await client.get("/health")
    assert resp.status == 503 and (await resp.json())["status"] == "loading"


async def test_props(client, service, text_assets):
    service.state = "sleeping"
    body = await (await client.get("/props")).json()
    assert body["n_ctx"] == 512 and body["is_sleeping"] is True
    assert body["chat_template"] == text_assets.chat_template
    assert body["model_path"] == "tiny"  # the file name: the server's path is its own


async def test_metrics_parse_as_prometheus_text(client, service):
    await client.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                  "content": "hi"}]})
    resp = await client.get("/metrics")
    assert resp.content_type == "text/plain"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(await resp.text())
               for s in family.samples}
    assert samples[("strata_requests_total", ())] == 1
    assert samples[("strata_completion_tokens_total", ())] == len(service.reply_ids())
    assert samples[("strata_tokens_per_second", ())] == 12.5
    assert samples[("strata_queue_length", ())] == 0
    assert samples[("strata_state", (("state", "loaded"),))] == 1
    assert samples[("strata_state", (("state", "sleeping"),))] == 0
    for name in ("strata_prompt_tokens_total", "strata_cached_tokens_total"):
        assert (name, ()) in samples


async def test_tokenize_detokenize_round_trip(client, text_assets):
    text = "The quick brown fox ✓ <|im_end|>"
    body = await (await client.post("/tokenize", json={"content": text})).json()
    assert body["tokens"] == text_assets.encode(text, add_special=False)
    back = await (await client.post("/detokenize", json={"tokens": body["tokens"]})).json()
    assert back["content"] == text_assets.decode(body["tokens"])
    assert back["content"].startswith("The quick brown fox ✓")
    pieces = await (await client.post("/tokenize", json={"content": "The quick",
                                                         "with_pieces": True})).json()
    assert "".join(p["piece"] for p in pieces["tokens"]) == "The quick"


async def test_v1_status_and_slots(client, service):
    assert (await (await client.get("/v1/status")).json())["state"] == "loaded"
    slots = await (await client.get("/slots")).json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3]


@pytest.mark.parametrize("path,action", [
    ("/load", "load"), ("/unload", "unload"), ("/sleep", "sleep"), ("/wake", "wake"),
    ("/cache/release", "release_experts"), ("/cache/refill", "refill_experts"),
    ("/session/offload", "offload_session")])
async def test_level_routes_call_control(client, service, path, action):
    resp = await client.post(path)
    assert resp.status == 200
    assert (await resp.json())["action"] == action
    assert service.calls == [("control", action, {})]


async def test_slot_actions(client, service):
    resp = await client.post("/slots/2?action=save", json={"filename": "chat-a.bin"})
    assert resp.status == 200
    assert await resp.json() == {"id_slot": 2, "filename": "chat-a.bin", "n_saved": 3,
                                 "n_written": 96, "timings": {"save_ms": 1.5}}
    resp = await client.post("/slots/2?action=restore", json={"filename": "chat-a.bin"})
    assert resp.status == 200 and (await resp.json())["n_restored"] == 3
    resp = await client.post("/slots/3?action=erase")
    assert resp.status == 200 and await resp.json() == {"id_slot": 3, "n_erased": 3}
    assert service.calls == [("control", "slot_save", {"slot": 2, "filename": "chat-a.bin"}),
                             ("control", "slot_restore", {"slot": 2, "filename": "chat-a.bin"}),
                             ("control", "slot_erase", {"slot": 3})]


async def test_apply_template_is_the_chat_prompt(client, service):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    response = await client.post("/apply-template", json={"messages": messages})
    assert response.status == 200
    prompt = (await response.json())["prompt"]
    assert prompt == service.text.apply_chat_template(messages)
    assert not service.requests  # nothing generated
    bad = await client.post("/apply-template", json={"messages": []})
    assert bad.status == 400


async def test_unprefixed_aliases_and_v1_health(client, service):
    assert (await client.get("/v1/health")).status == 200
    assert (await (await client.get("/models")).json())["data"][0]["id"] == service.model_id
    chat = await client.post("/chat/completions",
                             json={"messages": [{"role": "user", "content": "hi"}]})
    assert (await chat.json())["choices"][0]["message"]["content"] == service.reply_text
    done = await client.post("/completions", json={"prompt": "The", "max_tokens": 2})
    assert (await done.json())["usage"]["completion_tokens"] == 2


async def test_props_says_the_build_and_the_modalities(client):
    props = await (await client.get("/props")).json()
    assert props["build_info"].startswith("strata ")
    assert props["modalities"] == {"vision": False, "audio": False}
