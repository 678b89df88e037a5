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
    (4, "'id_slot' is 4"), (-1, "'id_slot' is -1"), ("1", "must be an integer"),
    (True, "must be an integer"), (1.5, "must be an integer"), (1e300, "slots are 0..3"),
])
async def test_body_slot_uses_the_same_validator(client, service, value, needle):
    resp = await client.post("/v1/chat/completions", json={"messages": USER, "id_slot": value})
    assert resp.status == 400
    assert needle in (await resp.json())["error"]["message"]
    assert service.calls == []


def test_one_slot_count_for_host_and_engine():
    from strata.engine import protocol
    from strata.engine.api import validation
    from strata.engine.service import service

    assert validation.NUM_CACHE_SLOTS is protocol.NUM_CACHE_SLOTS
    assert not hasattr(service, "NUM_CACHE_SLOTS")


async def test_odd_bytes_in_the_query_are_a_400(client, service):
    for query in ("action=%ED%A0%80", "action=%FF", "action=erase%00"):
        resp = await client.post(f"/slots/0?{query}")
        assert resp.status == 400, (query, await resp.text())
        assert "use ?action=save" in (await resp.json())["error"]["message"]
    assert service.calls == []
