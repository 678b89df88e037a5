"""Ollama's /api/pull through the real aiohttp app, against the local hub over real HTTP."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from filelock import FileLock

from strata.engine.api import create_app
from strata.engine.api.errors import ApiError
from strata.engine.api.ollama_pull import hub_spec
from tests.api.fake_service import FakeService

from .library_service import ndjson


async def test_stream_follows_ollamas_progress_shape(hub, client, library, gguf_bytes):
    hub.chunk_bytes = 1024
    response = await client.post("/api/pull", json={"model": "hf.co/acme/tiny-GGUF:Q8_0"})
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("application/x-ndjson")
    lines = ndjson(await response.text())
    assert lines[0] == {"status": "pulling manifest"}
    assert lines[-1] == {"status": "success"}
    pulling = [line for line in lines if line["status"] == "pulling tiny-Q8_0.gguf"]
    assert pulling[0]["completed"] == 0
    assert pulling[-1]["completed"] == pulling[-1]["total"] == len(gguf_bytes)
    assert pulling[0]["digest"].startswith("sha256:") and len(pulling[0]["digest"]) == 71
    assert any(line["status"] == "verifying sha256 digest" for line in lines)
    assert (library.models_dir / "acme/tiny-GGUF/tiny-Q8_0.gguf").read_bytes() == gguf_bytes
    assert library.num_rescans == 1


async def test_without_stream_answers_the_final_object(hub, client, library):
    response = await client.post("/api/pull", json={"name": "acme/tiny-hf", "stream": False,
                                                    "insecure": False})
    assert response.status == 200, await response.text()
    assert await response.json() == {"status": "success"}
    assert (library.models_dir / "acme/tiny-hf/config.json").is_file()


async def test_a_tagless_hf_co_name_takes_q4_k_m_as_ollama_does(hub, client, library):
    response = await client.post("/api/pull", json={"model": "hf.co/acme/tiny-GGUF:latest",
                                                    "stream": False})
    assert response.status == 200, await response.text()
    assert (library.models_dir / "acme/tiny-GGUF/tiny-Q4_K_M.gguf").is_file()


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"model": "llama3.2"}, 400, "Ollama's registry"),
    ({"model": "registry.ollama.ai/library/llama3.2:1b"}, 400, "hf.co/OWNER/REPO"),
    ({"model": "acme/tiny-GGUF:tiny-Q8_0.gguf", "insecure": True}, 400, "HF_ENDPOINT"),
    ({"model": "acme/tiny-GGUF", "username": "me"}, 400, "'username'"),
    ({"model": "acme/tiny-GGUF", "stream": "yes"}, 400, "'stream'"),
    ({}, 400, "'model'"),
    ({"model": "acme/missing", "stream": False}, 404, "was not found"),
    ({"model": "acme/tiny-GGUF", "stream": False}, 400, "several GGUF files"),
])
async def test_refusals_in_ollamas_error_shape(hub, client, library, body, status, words):
    response = await client.post("/api/pull", json=body)
    assert response.status == status
    error = (await response.json())["error"]
    assert words in error
    assert not list(library.models_dir.rglob("*.gguf")) if library.models_dir.exists() else True


async def test_an_error_mid_stream_ends_it_with_an_error_line(hub, client, library):
    hub.corrupt.add("tiny-Q8_0.gguf")
    response = await client.post("/api/pull", json={"model": "acme/tiny-GGUF:Q8_0"})
    assert response.status == 200  # the stream had started: the error is its last line
    lines = ndjson(await response.text())
    assert lines[0] == {"status": "pulling manifest"}
    assert "SHA-256" in lines[-1]["error"]
    assert library.num_rescans == 0


async def test_a_client_that_leaves_stops_the_download_and_the_next_pull_resumes(
        hub, client, library, gguf_bytes):
    hub.chunk_bytes, hub.chunk_delay_s = 512, 0.05  # about 1 s for the whole file
    response = await client.post("/api/pull", json={"model": "acme/tiny-GGUF:Q8_0"})
    while True:  # read until the file is on its way
        line = json.loads(await response.content.readline())
        if line.get("completed"):
            break
    response.close()  # the client goes away mid-file
    for _ in range(100):
        if hub.num_aborted:
            break
        await asyncio.sleep(0.05)
    assert hub.num_aborted == 1  # the hub saw the download broken off, not finished
    target = library.models_dir / "acme/tiny-GGUF"
    part = target / ".strata-partial/tiny-Q8_0.gguf.part"
    with FileLock(f"{part}.lock", timeout=5):  # the worker has let go of the part
        pass
    assert not (target / "tiny-Q8_0.gguf").exists()
    part_bytes = part.stat().st_size
    assert 0 < part_bytes < len(gguf_bytes)  # the part stays for the next pull
    assert library.num_rescans == 0
    hub.chunk_delay_s = 0.0
    hub.ranges.clear()
    again = await client.post("/api/pull", json={"model": "acme/tiny-GGUF:Q8_0",
                                                 "stream": False})
    assert again.status == 200
    assert hub.ranges == [("tiny-Q8_0.gguf", f"bytes={part_bytes}-")]  # only the rest
    assert (target / "tiny-Q8_0.gguf").read_bytes() == gguf_bytes


async def test_a_single_model_service_pulls_into_the_model_cache(hub, aiohttp_client, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("STRATA_HOME", str(tmp_path / "home"))
    plain = await aiohttp_client(create_app(FakeService(text=None)))
    response = await plain.post("/api/pull", json={"model": "acme/tiny-GGUF:Q8_0",
                                                   "stream": False})
    assert response.status == 200, await response.text()
    assert (tmp_path / "home/models/acme/tiny-GGUF/tiny-Q8_0.gguf").is_file()


async def test_the_ollama_client_pulls(hub, client, library):
    ollama = pytest.importorskip("ollama")
    url = f"http://{client.server.host}:{client.server.port}"

    def pull_with_client() -> list:
        return list(ollama.Client(host=url).pull("hf.co/acme/tiny-GGUF:Q8_0", stream=True))

    progress = await asyncio.to_thread(pull_with_client)
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    assert any(p.total and p.completed == p.total for p in progress)

    def refused() -> str:
        with pytest.raises(ollama.ResponseError) as info:
            ollama.Client(host=url).pull("llama3.2")
        return str(info.value)

    assert "Hugging Face hub" in await asyncio.to_thread(refused)


@pytest.mark.parametrize(("name", "spec", "preferred"), [
    ("hf.co/acme/tiny-GGUF:Q8_0", "acme/tiny-GGUF:Q8_0", None),
    ("huggingface.co/acme/tiny-GGUF", "acme/tiny-GGUF", "Q4_K_M"),
    ("HF.CO/acme/tiny-GGUF:latest", "acme/tiny-GGUF", "Q4_K_M"),
    ("acme/tiny-GGUF", "acme/tiny-GGUF", None),
    ("acme/tiny-GGUF:tiny-Q8_0.gguf", "acme/tiny-GGUF:tiny-Q8_0.gguf", None),
])
def test_names(name, spec, preferred):
    assert hub_spec(name) == (spec, preferred)


@pytest.mark.parametrize("name", ["llama3.2", "llama3.2:1b", "library/", "a/b/c",
                                  "ollama.com/library/x", " "])
def test_names_refused(name):
    with pytest.raises(ApiError):
        hub_spec(name)


async def test_a_pulled_model_is_listed_by_the_real_pool(hub, tmp_path, tiny_model_dir):
    """`strata serve` over the real ModelPool (fake engine): after /api/pull the pool rescans,
    so /api/tags lists the new model at once."""
    model_pool = pytest.importorskip("strata.engine.service.model_pool")
    from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig

    from strata.engine.service.service import Service
    from strata.engine.service.settings import ServeSettings
    from tests.helpers.serving import serving

    def make_service(settings, **options):
        return Service(settings, engine_factory=FAKE_ENGINE_FACTORY,
                       engine_config=FakeEngineConfig(model_path=str(tiny_model_dir)),
                       **options)

    settings = ServeSettings(model=str(tiny_model_dir), port=0, device="cpu",
                             context_tokens=256, models_dir=str(tmp_path / "library"),
                             snapshot_dir=str(tmp_path / "snapshots"))
    pool = model_pool.ModelPool(settings, service_factory=make_service)
    async with serving(settings, pool) as base_url, aiohttp.ClientSession() as session:
        async with session.post(f"{base_url}/api/pull",
                                json={"model": "hf.co/acme/tiny-GGUF:Q8_0"}) as response:
            lines = ndjson(await response.text())
        assert lines[-1] == {"status": "success"}
        async with session.get(f"{base_url}/api/tags") as response:
            names = [m["name"] for m in (await response.json())["models"]]
    assert any(name.startswith("tiny-Q8_0") for name in names), names
    assert (tmp_path / "library/acme/tiny-GGUF/tiny-Q8_0.gguf").is_file()
