"""Edge input that once gave 500s: lone surrogates in text (issue 17 item 9) and slot ids that
are not ASCII digits in range (item 10). Each is a 400 naming what is wrong, and nothing runs."""

from __future__ import annotations

import pytest

USER = [{"role": "user", "content": "hi"}]
LONE = "a\ud800b"  # valid JSON ("a\\ud800b") that is no Unicode text

# Every route that takes text, with the lone surrogate in its text field.
SURROGATE_CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": LONE}]}], "stream": True}, "messages"),
    ("/v1/chat/completions", {"messages": USER, "stop": [LONE]}, "stop"),
    ("/v1/completions", {"prompt": LONE, "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": LONE}, "stop"),
    ("/v1/messages", {"messages": [{"role": "user", "content": LONE}], "max_tokens": 2},
     "messages"),
    ("/v1/messages", {"messages": USER, "system": LONE, "max_tokens": 2}, "system"),
    ("/v1/messages", {"messages": USER, "max_tokens": 2, "stop_sequences": [LONE],
                      "stream": True}, "stop_sequences"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": LONE}]},
     "messages"),
    ("/tokenize", {"content": LONE}, "content"),
    ("/slots/0?action=save", {"filename": LONE}, "filename"),
    ("/slots/0?action=restore", {"filename": LONE}, "filename"),
    ("/v1/chat/completions", {"messages": USER, "model": "\udfff"}, "model"),
]


@pytest.mark.parametrize("path,body,field", SURROGATE_CASES,
                         ids=[f"{c[0]} {c[2]}" for c in SURROGATE_CASES])
async def test_lone_surrogate_is_a_400_naming_the_field(client, service, path, body, field):
    resp = await client.post(path, json=body)  # json.dumps escapes it as \ud800: valid JSON
    assert resp.status == 400, await resp.text()
    assert resp.content_type == "application/json"
    payload = await resp.json()
    error = payload["error"]
    assert "surrogate" in error["message"] and field in error["message"]
    if not path.startswith("/v1/messages"):
        assert error["param"] == field and error["code"] == "invalid_unicode"
    assert service.calls == []


async def test_paired_surrogates_are_ordinary_text(client):
    resp = await client.post("/tokenize", data=b'{"content": "\\ud83d\\ude00"}',
                             headers={"Content-Type": "application/json"})
    assert resp.status == 200 and (await resp.json())["tokens"]


@pytest.mark.parametrize("slot_text", [
    "%C2%B2",                  # superscript two: str.isdigit() is True, int() raises
    "\u0661",                  # Arabic-Indic one: int() takes it
    "\uff11",                  # full-width one: int() takes it
    "1" * 4301,                # past Python's int-from-string digit limit
    "4", "-1", "+1", " 1", "1.0", "0x1", "", "%ED%A0%80", "%FF", "0%00",
], ids=lambda text: repr(text[:12]))
async def test_slot_ids_are_ascii_digits_in_range(client, service, slot_text):
    resp = await client.post(f"/slots/{slot_text}?action=erase")
    if slot_text == "":
        assert resp.status == 404  # /slots/ is no slot route at all
        return
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert "slots are 0..3" in error["message"] and error["param"] == "id_slot"
    assert service.calls == []


async def test_slot_ids_in_range_work(client, service):
    for slot in range(4):
        assert (await client.post(f"/slots/{slot}?action=erase")).status == 200
    assert (await client.post("/slots/007?action=erase")).status == 400  # 7: out of range
    assert [call[2]["slot"] for call in service.calls] == [0, 1, 2, 3]


@pytest.mark.parametrize("value,needle", [
    (4, "'id_slot' is 4"), (-2, "'id_slot' is -2"), ("1", "must be an integer"),
    (True, "must be an integer"), (1.5, "must be an integer"), (1e300, "slots are 0..3"),
])
async def test_body_slot_uses_the_same_validator(client, service, value, needle):
    resp = await client.post("/v1/chat/completions", json={"messages": USER, "id_slot": value})
    assert resp.status == 400
    assert needle in (await resp.json())["error"]["message"]
    assert service.calls == []


@pytest.mark.parametrize("body", [{}, {"id_slot": -1}, {"id_slot": None}],
                         ids=["no slot field", "id_slot -1", "id_slot null"])
async def test_a_request_without_a_slot_lets_the_engine_pick(client, service, body):
    resp = await client.post("/v1/chat/completions", json={"messages": USER, **body})
    assert resp.status == 200, await resp.text()
    assert service.requests[-1].slot is None


async def test_strata_cache_slot_minus_one_is_refused(client, service):
    resp = await client.post("/v1/chat/completions",
                             json={"messages": USER, "strata_cache_slot": -1})
    assert resp.status == 400 and "'strata_cache_slot' is -1" in await resp.text()


async def test_slot_ids_follow_the_configured_slot_count(client, service):
    # The server's --slots, not protocol.NUM_CACHE_SLOTS: 6 slots take 5, refuse 6.
    service.num_slots = 6
    for route, body in (("/v1/chat/completions", {"messages": USER}),
                        ("/v1/messages", {"messages": USER, "max_tokens": 4}),
                        ("/completion", {"prompt": "hi"}),
                        ("/api/chat", {"model": "tiny-test-model", "messages": USER,
                                       "stream": False})):
        for name in ("strata_cache_slot", "id_slot"):
            if route == "/completion" and name == "strata_cache_slot":
                continue  # llama.cpp's route takes id_slot only
            ok = await client.post(route, json={**body, name: 5})
            assert ok.status == 200, (route, name, await ok.text())
            assert service.requests[-1].slot == 5
            refused = await client.post(route, json={**body, name: 6})
            assert refused.status == 400, (route, name)
            assert "slots are 0..5" in await refused.text()
    assert (await client.post("/slots/5?action=erase")).status == 200
    assert (await client.post("/slots/6?action=erase")).status == 400
    props = await (await client.get("/props")).json()
    assert props["total_slots"] == 6
    document = await (await client.get("/openapi.json")).json()
    chat = document["components"]["schemas"]
    maxima = {s["properties"][f]["maximum"] for s in chat.values() if isinstance(s, dict)
              for f in ("strata_cache_slot", "id_slot") if f in s.get("properties", {})}
    assert maxima == {5}


async def test_odd_bytes_in_the_query_are_a_400(client, service):
    for query in ("action=%ED%A0%80", "action=%FF", "action=erase%00"):
        resp = await client.post(f"/slots/0?{query}")
        assert resp.status == 400, (query, await resp.text())
        assert "use ?action=save" in (await resp.json())["error"]["message"]
    assert service.calls == []
