"""A FIFO, a device or a directory named as a model is refused by its file type before anything
opens it (issue 51, item 4): opening a FIFO blocks until a writer comes, so `strata serve`
never exited and, in a models directory, one request naming it held the pool's create lock and
every other model's first use hung."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from strata.engine.core.model_config import ModelConfig
from strata.engine.service.model_pool import ModelPool
from strata.engine.service.settings import ServeSettings
from tests.e2e.server import server_command, server_env
from tests.helpers.serving import serving

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from random_gguf import write_random_gguf

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")]

TINY_CONFIG = ModelConfig(model_type="llama", vocab_size=512, hidden_size=64,
                          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                          rope_theta=10000.0)


def unblock(fifo: Path) -> None:
    """Open the FIFO for writing once, so a reader stuck in open() (the old code) goes on."""
    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("command", ["serve", "info"])
def test_strata_with_a_fifo_as_the_model_exits_with_one_line(tmp_path, command) -> None:
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    args = [*server_command(), "info", str(fifo)] if command == "info" else [
        *server_command(), "serve", "--model", str(fifo), "--device", "cpu", "--port", "0",
        "--snapshot-dir", str(tmp_path / "snapshots")]
    try:
        done = subprocess.run(args, check=False, capture_output=True, text=True, timeout=120,
                              env=server_env(tmp_path))
    except subprocess.TimeoutExpired as exc:
        unblock(fifo)
        pytest.fail(f"strata {command} hung on a FIFO named as the model:\n{exc.stderr}")
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("strata: error:")]
    assert len(errors) == 1, done.stderr
    assert "named pipe (FIFO)" in errors[0] and str(fifo) in errors[0]
    assert "Traceback" not in done.stderr + done.stdout


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def pool_server(tmp_path_factory):
    """serve() over a ModelPool: a tiny llama as the default, another in the models directory
    beside a FIFO and a directory named *.gguf."""
    default_path = tmp_path_factory.mktemp("default") / "tiny-a.gguf"
    write_random_gguf(TINY_CONFIG, default_path)
    models_dir = tmp_path_factory.mktemp("models")
    write_random_gguf(TINY_CONFIG, models_dir / "tiny-b.gguf", seed=1)
    os.mkfifo(models_dir / "fifo.gguf")
    (models_dir / "folder.gguf").mkdir()
    settings = ServeSettings(model=str(default_path), port=0, device="cpu", context_tokens=128,
                             slots=1, models_dir=str(models_dir),
                             snapshot_dir=str(tmp_path_factory.mktemp("snapshots")))
    pool = ModelPool(settings, {})
    try:
        async with serving(settings, pool) as base_url:
            yield base_url, models_dir
    finally:
        unblock(models_dir / "fifo.gguf")


async def complete(base: str, model: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    async with aiohttp.ClientSession() as session, \
            session.post(f"{base}/v1/completions", json=body) as response:
        return response.status, await response.json()


@pytest.mark.asyncio(loop_scope="module")
async def test_a_fifo_in_the_models_dir_is_refused_and_other_models_still_load(pool_server):
    base, _ = pool_server
    async with asyncio.timeout(120):  # the old code never answered
        status, answer = await complete(base, "fifo")
    assert status == 400, answer
    message = answer["error"]["message"]
    assert "named pipe (FIFO)" in message and "not a regular file" in message, message
    status, answer = await complete(base, "folder")
    assert status == 400 and "folder.gguf" in answer["error"]["message"], answer
    async with asyncio.timeout(120):  # its first use: a member created after the refusals
        status, answer = await complete(base, "tiny-b")
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] >= 1
