"""/api/pull when the hub cannot answer (offline mode, nothing listening, not a hub): an error
in Ollama's shape with a status that says so, and in a stream a last error line, never a cut."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from strata.library.pull import PullError, pull

from .library_service import ndjson

pytestmark = pytest.mark.usefixtures("hub")


def go_offline(monkeypatch) -> None:
    """HF_HUB_OFFLINE=1 as the server was started with: huggingface_hub reads it at import."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def offline(monkeypatch):
    go_offline(monkeypatch)


@pytest.fixture
async def trouble(request, aiohttp_server, monkeypatch):
    """The hub in trouble as request.param says: offline (HF_HUB_OFFLINE), unreachable
    (HF_ENDPOINT naming a port nothing listens on) or not_a_hub (a web server that answers
    every path with a page, not a listing)."""
    if request.param == "offline":
        go_offline(monkeypatch)
    elif request.param == "unreachable":
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    else:
        async def page(request: web.Request) -> web.Response:
            return web.Response(text="<html>hello</html>")

        app = web.Application()
        app.router.add_get("/{path:.*}", page)
        server = await aiohttp_server(app)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.port}")


CASES = [("offline", 503, "HF_HUB_OFFLINE"), ("unreachable", 502, "cannot reach"),
         ("not_a_hub", 502, "not a model listing")]


@pytest.mark.parametrize(("trouble", "status", "words"), CASES, indirect=["trouble"])
async def test_without_stream_the_answer_is_the_error_with_its_status(
        trouble, client, library, status, words):
    response = await client.post("/api/pull", json={"model": "hf.co/acme/tiny-GGUF:Q8_0",
                                                    "stream": False})
    assert response.status == status
    body = await response.json()
    assert list(body) == ["error"] and words in body["error"]
    assert "\n" not in body["error"]
    assert not library.models_dir.exists()


@pytest.mark.parametrize(("trouble", "status", "words"), CASES, indirect=["trouble"])
async def test_a_stream_ends_with_an_error_line(trouble, client, library, status, words):
    response = await client.post("/api/pull", json={"model": "hf.co/acme/tiny-GGUF:Q8_0"})
    assert response.status == 200  # the stream had started: the error is its last line
    lines = ndjson(await response.text())
    assert lines[0] == {"status": "pulling manifest"}
    assert list(lines[-1]) == ["error"] and words in lines[-1]["error"]
    assert library.num_rescans == 0


async def test_strata_pull_offline_says_what_to_unset(offline, tmp_path):
    with pytest.raises(PullError, match="HF_HUB_OFFLINE"):
        await asyncio.to_thread(pull, "acme/tiny-GGUF:Q8_0", tmp_path, progress=False)
    assert list(tmp_path.iterdir()) == []


async def test_the_ollama_client_sees_the_offline_error(offline, client):
    ollama = pytest.importorskip("ollama")
    url = f"http://{client.server.host}:{client.server.port}"

    def pull_with_client(is_stream: bool) -> str:
        with pytest.raises(ollama.ResponseError) as info:
            result = ollama.Client(host=url).pull("hf.co/acme/tiny-GGUF:Q8_0", stream=is_stream)
            if is_stream:
                list(result)
        return str(info.value)

    assert "HF_HUB_OFFLINE" in await asyncio.to_thread(pull_with_client, False)
    assert "HF_HUB_OFFLINE" in await asyncio.to_thread(pull_with_client, True)
