"""The real engine process (the real Engine on a tiny llama, CPU) behind `serve`, over HTTP:
usage after a stop string, persisted sessions that survive a SIGKILL, and a model that stops
loading at run time (issue 17 items 12, 13 and 8)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from fakes.tiny_model import write_tiny_model_dir
from helpers.processes import kill_hard

from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from tests.helpers.serving import serving
from tests.snapshots.helpers import VOCAB, save_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

PROMPT = " ".join(f"w{(i * 7) % (VOCAB - 10) + 3}" for i in range(40))  # 40 tokens


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(tmp_path_factory):
    """serve() over a Service with the default (real) engine factory; yields (base, service)."""
    model_dir = save_tiny_llama(tmp_path_factory.mktemp("real-tiny"), seed=0)
    write_tiny_model_dir(model_dir, vocab_size=VOCAB)  # its tokenizer, ids match the model's
    settings = ServeSettings(
        model=str(model_dir), port=0, device="cpu", context_tokens=256,
        persist_sessions=True, snapshot_ram_budget_bytes=0,  # an offload writes the file
        snapshot_dir=str(tmp_path_factory.mktemp("snapshots")))
    service = Service(settings)
    async with serving(settings, service) as base_url:
        yield base_url, service, settings


async def complete(base: str, **body) -> dict:
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 8, **body}
    async with aiohttp.ClientSession() as session, \
            session.post(f"{base}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_a_stop_string_reports_the_engines_cached_tokens(server):
    base, _, _ = server
    plain = await complete(base, max_tokens=12)
    words = plain["choices"][0]["text"].split()
    assert len(words) >= 4, plain
    stop_word = words[3]  # greedy: the same words come again; cut at the fourth one
    for stream in (False, True):
        if stream:
            answer = await complete_streamed(base, stop=[stop_word], max_tokens=12)
        else:
            answer = await complete(base, stop=[stop_word], max_tokens=12)
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert stop_word not in answer["choices"][0]["text"].split()
        # The same prompt again on the same slot: all but its last token came from cache.
        assert cached(answer) == answer["usage"]["prompt_tokens"] - 1 > 0, answer
        assert answer["usage"]["completion_tokens"] <= words.index(stop_word) + 1


async def complete_streamed(base: str, **body) -> dict:
    """A streamed completion with include_usage, folded into one answer."""
    import json

    body = {"prompt": PROMPT, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    text, finish, usage = "", None, None
    async with aiohttp.ClientSession() as session, \
            session.post(f"{base}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    return {"choices": [{"text": text, "finish_reason": finish}], "usage": usage}


async def test_a_persisted_session_survives_a_sigkill_of_the_engine(server):
    base, service, settings = server
    await complete(base, max_tokens=4)
    async with aiohttp.ClientSession() as session, \
            session.post(f"{base}/session/offload") as response:
        assert response.status == 200, await response.text()
    files = sorted(os.listdir(settings.snapshot_dir))
    assert len(files) == 1 and files[0].startswith("slot0-"), files
    restored = await complete(base, max_tokens=4)  # the slot comes back from its file
    assert cached(restored) == restored["usage"]["prompt_tokens"] - 1
    assert sorted(os.listdir(settings.snapshot_dir)) == files  # kept until replaced

    pid = service.status()["engine_pid"]
    kill_hard(pid)  # as the OOM killer would (TerminateProcess on Windows)
    deadline_s = time.monotonic() + 120
    while service.status()["engine_pid"] in (None, pid) or service.status()["engine"]["state"] != "loaded":
        assert time.monotonic() < deadline_s, service.status()
        await asyncio.sleep(0.1)
    again = await complete(base, max_tokens=4)
    assert cached(again) == again["usage"]["prompt_tokens"] - 1 > 0, again
    assert again["choices"][0]["text"] == restored["choices"][0]["text"]


async def test_a_model_that_stops_loading_at_run_time_is_failed_with_the_reason(server):
    base, service, settings = server
    config = Path(settings.model) / "config.json"
    original = config.read_text(encoding="utf-8")
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/unload") as response:
            assert response.status == 200, await response.text()
        try:
            # An architecture Strata cannot run; the tokenizer still reads the directory.
            config.write_text(original.replace('"llama"', '"nosucharch"'), encoding="utf-8")
            async with session.post(f"{base}/load") as response:
                body = await response.json()
                assert response.status == 503, body
            async with session.get(f"{base}/v1/status") as response:
                status = await response.json()
            assert status["state"] == "failed", status
            assert "nosucharch" in status["last_error"], status
        finally:
            config.write_text(original, encoding="utf-8")
        async with session.post(f"{base}/load") as response:
            assert response.status == 200, await response.text()
    assert service.status()["engine"]["state"] == "loaded"  # (the session file is on disk)


def _mount_tool(tool: str, *args: str) -> bool:
    """Run mount or umount (a blink: no need to leave the loop); True when it worked."""
    import shutil
    import subprocess

    return shutil.which(tool) is not None and subprocess.run(
        [tool, *args], capture_output=True, check=False).returncode == 0


def _mount(*args: str) -> bool:
    return _mount_tool("mount", *args)


async def save_slot(base: str, filename: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, \
            session.post(f"{base}/slots/0?action=save", json={"filename": filename}) as response:
        return response.status, await response.json()


async def test_a_full_or_read_only_disk_on_save_is_a_server_error(server):
    base, _, settings = server
    await complete(base, max_tokens=4)  # slot 0 holds a history of about 20 KiB of KV
    directory = settings.snapshot_dir
    if not _mount("-t", "tmpfs", "-o", "size=4k,mode=0700", "tmpfs", directory):
        pytest.skip("mounting a tmpfs needs root")
    try:
        status, body = await save_slot(base, "big.slot")
        assert status == 507, body
        assert body["error"]["code"] == "insufficient_storage", body
        assert "No space left" in body["error"]["message"] and "\n" not in body["error"]["message"]
        assert _mount("-o", "remount,ro", directory)
        status, body = await save_slot(base, "big.slot")
        assert status == 500 and body["error"]["code"] == "read_only_storage", body
        assert "Read-only" in body["error"]["message"], body
    finally:
        _mount_tool("umount", "-l", directory)
    status, body = await save_slot(base, "big.slot")  # the real directory again: it works
    assert status == 200, body


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs are POSIX")
async def test_a_fifo_named_like_a_slot_file_is_refused_at_once(server):
    base, service, settings = server
    fifo = Path(settings.snapshot_dir) / "x.slot"
    os.mkfifo(fifo)
    try:
        started_s = time.monotonic()
        async with aiohttp.ClientSession() as session, session.post(
                f"{base}/slots/0?action=restore", json={"filename": "x.slot"}) as response:
            body = await response.json()
        assert response.status == 400, body
        assert "not a regular file" in body["error"]["message"], body
        assert time.monotonic() - started_s < 10  # refused, not blocked until the timeout
    finally:
        fifo.unlink()
    assert service.status()["engine"]["state"] == "loaded"
    assert (await complete(base, max_tokens=2))["usage"]["completion_tokens"] == 2
