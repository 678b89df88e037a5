"""Host allow-list, Origin check, CORS and API key."""

from __future__ import annotations

import pytest

USER = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("host,status", [
    ("localhost", 200), ("localhost:8080", 200), ("127.0.0.1:1", 200), ("[::1]", 200),
    ("[::1]:8080", 200), ("LOCALHOST.", 200), ("evil.example", 403),
    ("evil.example:8080", 403), ("127.0.0.1.nip.io", 403), ("localhost:notaport", 403),
    ("", 403),
    # Zone ids and junk around a loopback name (issue 51 item 8): not that name.
    ("localhost%anything", 403), ("localhost%25x:8080", 403), ("[::1%lo]:8080", 403),
    ("[::1%25lo]", 403), ("localhost:\u0668\u0660", 403), ("127.0.0.1:+80", 403),
    ("localhost :80", 403), ("local host", 403),
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
                             headers={"Origin": f"http://127.0.0.1.nip.io:{client.port}"})
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


# Local pages and desktop-app shells may call a local server by default, as with Ollama.
DEFAULT_ALLOWED = ["http://localhost:3000", "http://localhost", "https://localhost:8443",
                   "http://127.0.0.1:5173", "http://[::1]:8080", "app://strata-chat",
                   "file://", "tauri://localhost", "vscode-webview://abc123", "HTTP://LocalHost:1"]
FOREIGN = ["http://evil.example", "https://localhost.evil.example", "http://localhost.:3000.x",
           "http://localhost:3000@evil.example", "http://localhost:abc", "null",
           "http://127.0.0.1.nip.io", "chrome-extension://abc", "https://[::1].evil:1"]


@pytest.mark.parametrize("origin", DEFAULT_ALLOWED)
async def test_local_origins_are_allowed_by_default_with_cors(client, origin):
    resp = await client.post("/v1/chat/completions", json=USER, headers={"Origin": origin})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Access-Control-Allow-Origin"] == origin
    assert "Origin" in resp.headers.getall("Vary")
    preflight = await client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    assert preflight.status == 200  # llama-server's status; 204 failed its tests
    assert preflight.headers["Access-Control-Allow-Origin"] == origin
    assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
    assert "x-stainless-os" in preflight.headers["Access-Control-Allow-Headers"]
    assert int(preflight.headers["Access-Control-Max-Age"]) > 0


@pytest.mark.parametrize("origin", FOREIGN)
async def test_foreign_origins_are_refused_naming_the_option(client, service, origin):
    resp = await client.post("/v1/chat/completions", json=USER, headers={"Origin": origin})
    assert resp.status == 403
    error = (await resp.json())["error"]
    assert "--allowed-origins" in error["message"] and error["code"] == "origin_refused"
    assert "Access-Control-Allow-Origin" not in resp.headers
    preflight = await client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST"})
    # 200 as llama-server answers; without the Origin's grant the browser sends nothing.
    assert preflight.status == 200 and "Access-Control-Allow-Origin" not in preflight.headers
    assert "Access-Control-Allow-Methods" not in preflight.headers
    # A read is answered, but without CORS headers the browser keeps it from the page.
    read = await client.get("/v1/models", headers={"Origin": origin})
    assert read.status == 200 and "Access-Control-Allow-Origin" not in read.headers
    assert service.calls == []


async def test_configured_origins_and_patterns(make_client):
    client = await make_client(allowed_origins=["https://chat.example.com", "http://10.0.0.5:*",
                                                "null"])
    for origin in ("https://chat.example.com", "http://10.0.0.5:3000", "null"):
        resp = await client.post("/sleep", headers={"Origin": origin})
        assert resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == origin
    for origin in ("https://chat.example.com.evil", "http://10.0.0.50:3000"):
        assert (await client.post("/sleep", headers={"Origin": origin})).status == 403


@pytest.mark.parametrize("origin", ["https://web.example.fr", "localhost", "null"])
async def test_any_origin_mode_answers_preflights_as_llama_server(make_client, origin):
    """--allowed-origins '*' is llama-server's default: every Origin, even one that is no URL
    (its tests send 'localhost'), gets a 200 preflight granting it."""
    client = await make_client(allowed_origins=["*"])
    preflight = await client.options("/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "Authorization"})
    assert preflight.status == 200
    assert preflight.headers["Access-Control-Allow-Origin"] == origin
    # Echoed, not '*': a '*' would not cover Authorization (Fetch standard).
    assert preflight.headers["Access-Control-Allow-Headers"] == "Authorization"
    assert "Access-Control-Allow-Credentials" not in preflight.headers


async def test_cors_on_streams_errors_and_preflights_without_a_key(make_client):
    client = await make_client(api_key="s3cret")
    origin = "http://localhost:3000"
    preflight = await client.options("/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST"})
    assert preflight.status == 200  # browsers send preflights without credentials
    assert preflight.headers["Access-Control-Allow-Origin"] == origin
    unauthorized = await client.post("/v1/chat/completions", json=USER,
                                     headers={"Origin": origin})
    assert unauthorized.status == 401  # and the page may read why
    assert unauthorized.headers["Access-Control-Allow-Origin"] == origin
    stream = await client.post("/v1/chat/completions", json={**USER, "stream": True},
                               headers={"Origin": origin, "Authorization": "Bearer s3cret"})
    assert stream.status == 200 and stream.content_type == "text/event-stream"
    assert stream.headers["Access-Control-Allow-Origin"] == origin
    assert "[DONE]" in await stream.text()


async def test_host_error_names_the_option(client):
    resp = await client.get("/v1/models", headers={"Host": "evil.example"})
    assert "--allowed-hosts" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize("origin,pattern,expected", [
    ("http://localhost:3000", "http://localhost:*", True),
    ("http://localhost", "http://localhost:*", True),
    ("http://localhost.evil.com", "http://localhost:*", False),
    ("http://localhost:3000.evil.com", "http://localhost:*", False),
    ("http://localhost:", "http://localhost:*", False),
    ("app://x", "app://*", True), ("app://", "app://*", False),
    ("https://a.b", "*", True), ("https://a.b/", "https://a.b", True),
])
def test_origin_patterns(origin, pattern, expected):
    from strata.engine.api.origins import origin_matches

    assert origin_matches(origin, pattern) is expected
