"""Names from a hub (a mirror in HF_ENDPOINT may be hostile) never become paths outside the
library: `strata pull` and /api/pull against a local hub over real HTTP, real huggingface_hub."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from strata.cli import main
from strata.engine.api import create_app
from strata.library.pull import PullError, pull
from strata.library.transfer import Source, fetch

from .fake_hub import FakeHub
from .library_service import LibraryService, ndjson

PAYLOAD = b"GGUF hostile bytes"


def hostile_names(root: Path) -> list[str]:
    """File names a listing may carry that leave the library (on Linux or on Windows), or that
    no file system holds."""
    return ["../../x.gguf", f"{root}/abs/x.gguf", "sub/../../../y.gguf", "a\\..\\..\\z.gguf",
            "C:/Users/x.gguf", "c:x.gguf", "n\x00.gguf", "./w.gguf", "sub//v.gguf",
            "sub/./v.gguf", ".. /v.gguf", "tab\t.gguf", "//host/share/x.gguf"]


@pytest.fixture
async def hostile(aiohttp_server, monkeypatch):
    """A mirror that lists what a test gives it and answers any path with PAYLOAD, whose
    SHA-256 the listing advertises: nothing but Strata's own checks stops a write."""
    fake = FakeHub(any_path_bytes=PAYLOAD)
    server = await aiohttp_server(fake.app())
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.port}")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return fake


def written(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*"))


async def test_every_hostile_file_name_is_refused_before_anything_is_written(
        hostile, tmp_path):
    models = tmp_path / "lib/models"
    for name in hostile_names(tmp_path):
        hostile.repos = {"acme/evil": {name: PAYLOAD}}
        with pytest.raises(PullError, match="refused") as info:
            await asyncio.to_thread(pull, "acme/evil", models, progress=False)
        assert "\n" not in str(info.value) and "acme/evil" in str(info.value), name
        assert written(tmp_path) == [], (name, written(tmp_path))
    # refused from the listing: no file was asked for
    assert all(path.startswith("/api/models/") for _, path in hostile.requests)


async def test_a_hostile_name_in_a_hugging_face_directory_is_refused(hostile, tmp_path):
    hostile.repos = {"acme/evil-hf": {"config.json": b"{}", "model.safetensors": PAYLOAD,
                                      "..\\..\\evil.safetensors": PAYLOAD}}
    with pytest.raises(PullError, match="refused"):
        await asyncio.to_thread(pull, "acme/evil-hf", tmp_path / "models", progress=False)
    assert written(tmp_path) == []


async def test_a_listing_whose_commit_is_a_path_is_refused(hostile, tmp_path):
    hostile.repos = {"acme/evil": {"x.gguf": PAYLOAD}}
    # the listing's commit is what every file URL is pinned to: a path there is refused too
    hostile.commit = "../../../x"
    with pytest.raises(PullError, match="commit"):
        await asyncio.to_thread(pull, "acme/evil", tmp_path / "models", progress=False)
    assert written(tmp_path) == []


async def test_a_safe_subfolder_name_still_pulls(hostile, tmp_path):
    hostile.repos = {"acme/good": {"quants/good-Q8_0.gguf": PAYLOAD}}
    path = await asyncio.to_thread(pull, "acme/good", tmp_path / "models", progress=False)
    assert path == tmp_path / "models/acme/good/quants/good-Q8_0.gguf"
    assert path.read_bytes() == PAYLOAD


def test_fetch_itself_refuses_a_name_that_leaves_its_folder(tmp_path):
    """The transfer checks the name it writes too, whoever calls it."""
    source = Source("http://127.0.0.1:9/x", {}, identity="x", size_bytes=1, sha256=None,
                    repo="acme/evil", label="x of acme/evil")
    target = tmp_path / "models/acme/evil"
    for name in ["../x.gguf", str(tmp_path / "x.gguf"), "a/../../x.gguf"]:
        with pytest.raises(PullError, match="refused"):
            fetch(source, target, name, on_bytes=lambda done_bytes: None)
    assert written(tmp_path) == []


@pytest.mark.parametrize("spec", ["acme/..", "../..:x.gguf", "acme/a--b", "acme/x.git",
                                  "-acme/x", "acme/x-", "acme/caf\u00e9", "acme/a b",
                                  "acme/a\\b", "acme/" + "x" * 97])
async def test_repository_ids_the_hub_refuses_are_refused_before_asking_it(
        hostile, tmp_path, spec):
    with pytest.raises(PullError, match="repository id"):
        await asyncio.to_thread(pull, spec, tmp_path / "models", progress=False)
    assert hostile.requests == [] and written(tmp_path) == []


async def test_cli_pull_of_a_hostile_listing_is_a_one_line_error(hostile, tmp_path, capsys):
    hostile.repos = {"acme/evil": {"../../x.gguf": PAYLOAD}}
    code = await asyncio.to_thread(main, ["pull", "acme/evil", "--models-dir",
                                          str(tmp_path / "models")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "refused" in err and len(err.splitlines()) == 1
    assert written(tmp_path) == []


@pytest.fixture
async def api(aiohttp_client, tmp_path):
    library = LibraryService(tmp_path / "lib/models")
    client = await aiohttp_client(create_app(library),
                                  server_kwargs={"handler_cancellation": True})
    return client, library


@pytest.mark.parametrize("is_stream", [False, True])
async def test_api_pull_of_a_hostile_listing_is_an_error_and_writes_nothing(
        hostile, api, tmp_path, is_stream):
    client, library = api
    for name in ["../../x.gguf", f"{tmp_path}/abs/x.gguf", "n\x00.gguf", "a\\..\\x.gguf"]:
        hostile.repos = {"acme/evil": {name: PAYLOAD}}
        response = await client.post("/api/pull", json={"model": "hf.co/acme/evil",
                                                        "stream": is_stream})
        if is_stream:
            assert response.status == 200
            lines = ndjson(await response.text())
            assert lines[0] == {"status": "pulling manifest"}
            assert "refused" in lines[-1]["error"], name
            assert not any(line.get("status") == "success" for line in lines)
        else:
            assert response.status == 502, name
            assert "refused" in (await response.json())["error"]
        assert written(tmp_path) == [], (name, written(tmp_path))
    assert library.num_rescans == 0


@pytest.mark.parametrize("is_stream", [False, True])
@pytest.mark.parametrize("model", ["acme/..", "hf.co/acme/a--b:Q4_K_M", "acme/x.git",
                                   "acme/-x"])
async def test_api_pull_of_a_bad_repository_id_is_a_400(hostile, api, tmp_path, model,
                                                        is_stream):
    client, _ = api
    response = await client.post("/api/pull", json={"model": model, "stream": is_stream})
    assert response.status == 400
    body = await response.json()
    assert "repository id" in body["error"] and body == {"error": body["error"]}
    assert hostile.requests == [] and written(tmp_path) == []

