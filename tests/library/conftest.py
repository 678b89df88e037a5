"""Fixtures: a local hub over real HTTP (fake_hub.py) serving a tiny GGUF and an HF directory."""

from __future__ import annotations

import json

import pytest

from strata.engine.api import create_app
from tests.text.spm_gguf import write_spm_gguf

from .fake_hub import FakeHub
from .library_service import LibraryService


@pytest.fixture
def gguf_bytes(tmp_path_factory) -> bytes:
    return write_spm_gguf(tmp_path_factory.mktemp("spm") / "m.gguf").read_bytes()


@pytest.fixture
async def hub(aiohttp_server, gguf_bytes, monkeypatch):
    fake = FakeHub(repos={
        "acme/tiny-GGUF": {"tiny-Q8_0.gguf": gguf_bytes, "tiny-Q4_K_M.gguf": gguf_bytes + b"4",
                           "README.md": b"# tiny"},
        "acme/tiny-hf": {"config.json": json.dumps({"model_type": "llama"}).encode(),
                         "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
                         "tokenizer.json": b"{}", "README.md": b"# tiny", "pic.png": b"x"},
    })
    server = await aiohttp_server(fake.app())
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.port}")
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return fake


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tokenizer directory the fake engine and the real Service accept as a model."""
    from fakes.tiny_model import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def library(tmp_path) -> LibraryService:
    return LibraryService(tmp_path / "models")


@pytest.fixture
async def client(aiohttp_client, library):
    # handler_cancellation as `strata serve` runs it (listen.py): a client gone cancels
    return await aiohttp_client(create_app(library),
                                server_kwargs={"handler_cancellation": True})
