"""Host allow-list, Origin check and API key."""

from __future__ import annotations

import pytest

USER = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("host,status", [
    ("localhost", 200), ("localhost:8080", 200), ("127.0.0.1:1", 200), ("[::1]", 200),
    ("[::1]:8080", 200), ("LOCALHOST.", 200), ("evil.example", 403),
    ("evil.example:8080", 403), ("127.0.0.1.nip.io", 403), ("localhost:notaport", 403),
    ("", 403),
])
async def test_host_header_must_be_loopback(client, host, status):
    resp = await client.get("/v1/models", headers={"Host": host})
    assert resp.status == status
    if status == 403:
        assert "is not allowed" in (await resp.json())["error"]["message"]


async def test_configured_hosts_are_allowed(make_client):
    client = await make_client(allowed_hosts=["strata.lan"])
    assert (await client.get("/health", headers={"Host": "strata.lan:8080"})).status == 200
    assert (await client.get("/health", headers={"Host": "other.lan"})).status == 403


async def test_cross_site_post_is_refused(client, service):
    own = f"http://127.0.0.1:{client.port}"
    resp = await client.post("/sleep", headers={"Origin": "http://evil.example"})
    assert resp.status == 403
    assert "cross-site" in (await resp.json())["error"]["message"]
    resp = await client.post("/v1/messages", json={**USER},
                             headers={"Origin": f"http://127.0.0.1:{client.port + 1}"})
    assert resp.status == 403 and (await resp.json())["error"]["type"] == "permission_error"
    assert (await client.post("/sleep", headers={"Origin": "null"})).status == 403
    assert service.calls == []
    assert (await client.post("/sleep", headers={"Origin": own})).status == 200
    # Reads are not state changes: a foreign Origin on GET is answered.
    assert (await client.get("/health", headers={"Origin": "http://evil.example"})).status == 200


async def test_allowed_origin(make_client):
    client = await make_client(allowed_origins=["http://localhost:3000/"])
    resp = await client.post("/sleep", headers={"Origin": "http://localhost:3000"})
    assert resp.status == 200


async def test_api_key(make_client, service):
    client = await make_client(api_key="s3cret")
    resp = await client.post("/v1/chat/completions", json=USER)
    assert resp.status == 401 and "missing API key" in (await resp.json())["error"]["message"]
    resp = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert resp.status == 401 and "wrong API key" in (await resp.json())["error"]["message"]
    resp = await client.post("/v1/messages", json={**USER}, headers={"x-api-key": "nope"})
    assert resp.status == 401
    assert (await resp.json())["error"]["type"] == "authentication_error"
    assert service.calls == []
    assert (await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status \
        == 200
    assert (await client.get("/metrics", headers={"x-api-key": "s3cret"})).status == 200
    assert (await client.post("/v1/chat/completions", json=USER,
                              headers={"Authorization": "bearer s3cret"})).status == 200
    assert (await client.get("/health")).status == 200  # health checks need no key
