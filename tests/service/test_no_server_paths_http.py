"""HTTP clients see file names, never the server's absolute paths (issue 17 item 4): in /props,
/v1/status, /slots and error messages. Real Service and engine process loop (fake engine)."""

from __future__ import annotations

import json

import pytest
from fakes.services import answer, make_service

from strata.engine.api import create_app

pytestmark = pytest.mark.timeout(120)


async def test_paths_become_file_names(tiny_model_dir, tmp_path, aiohttp_client):
    snapshots = tmp_path / "private-snapshots"
    service = make_service(tiny_model_dir, engine={"snapshot_dir": str(snapshots)})
    await service.start()
    try:
        assert str(tiny_model_dir) in json.dumps(service.status(), default=str)  # locally: yes
        client = await aiohttp_client(create_app(service))
        await service.control("load")
        await answer(service, [5, 6, 7], slot=0)
        texts = {}
        for route in ("/props", "/v1/status", "/slots", "/v1/models", "/health", "/metrics"):
            resp = await client.get(route)
            assert resp.status == 200, route
            texts[route] = await resp.text()
        props = json.loads(texts["/props"])
        assert props["model_path"] == tiny_model_dir.name
        assert json.loads(texts["/v1/status"])["model_path"] == tiny_model_dir.name
        resp = await client.post("/slots/0?action=restore", json={"filename": "absent.json"})
        assert resp.status == 400
        texts["restore"] = await resp.text()
        assert "absent.json" in texts["restore"]
        for route, text in texts.items():
            assert str(tmp_path) not in text and str(tiny_model_dir) not in text, route
    finally:
        await service.stop()


@pytest.mark.parametrize("text,expected", [
    ("could not write KV snapshot /tmp/a/b/chat.stkv: disk full",
     "could not write KV snapshot chat.stkv: disk full"),
    ("cannot read '/root/models/x.gguf'", "cannot read 'x.gguf'"),
    ("C:\\Users\\me\\m.gguf is bad", "m.gguf is bad"),
    # Routes and URLs are no server paths.
    ("no route POST /foo; see /v1/models, /v1/chat/completions",
     "no route POST /foo; see /v1/models, /v1/chat/completions"),
    ("serving at http://127.0.0.1:8080/v1/models", "serving at http://127.0.0.1:8080/v1/models"),
])
def test_redact_text(text, expected):
    from strata.engine.api.redact import redact_text

    assert redact_text(text) == expected
