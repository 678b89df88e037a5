"""`strata serve` start-up: the port is checked before the model loads, the load reports
progress, and Ctrl-C during the load stops at once (issue #17 item 18)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
import subprocess
import time

import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, FakeEngineConfig

from strata.default_model import DefaultModelError, default_model_path
from strata.engine.service.service import Service
from strata.engine.service.settings import ServeSettings
from strata.host.serve import ServeError, report_load_progress, serve
from tests.e2e.server import server_command, server_env

pytestmark = pytest.mark.timeout(120)


async def test_a_busy_port_fails_before_any_engine_starts(tiny_model_dir):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        settings = ServeSettings(model=str(tiny_model_dir), port=port)
        service = Service(settings, engine_factory=FAKE_ENGINE_FACTORY,
                          engine_config=FakeEngineConfig(model_path=str(tiny_model_dir)))
        with pytest.raises(ServeError) as error:
            await serve(settings, service=service, stop_event=asyncio.Event())
    message = str(error.value)
    assert f"127.0.0.1:{port}" in message and "--port" in message and "\n" not in message
    assert service.status()["engine_starts"] == 0  # nothing was loaded to find that out


def test_a_busy_port_is_one_line_and_a_nonzero_exit(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = subprocess.run([*server_command(), "serve", "--port", str(port), "--device",
                               "cpu"], capture_output=True, text=True, timeout=60,
                              env=server_env(tmp_path), check=False)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [(
        f"strata: error: cannot listen on 127.0.0.1:{port} (Address already in use); "
        "pick another port with --port")], done.stderr


class _LoadingService:
    """Only what report_load_progress reads: a status that says the load goes on."""

    model_id = "big-model"
    model_path = None

    def status(self) -> dict:
        return {"state": "loading"}


async def test_a_long_load_prints_the_model_then_the_seconds_so_far():
    stream = io.StringIO()  # not a terminal: a line every 5 ticks, no carriage returns
    task = asyncio.create_task(report_load_progress(_LoadingService(), poll_s=0.01,
                                                    tick_s=0.05, stream=stream))
    await asyncio.sleep(0.8)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    lines = stream.getvalue().splitlines()
    assert lines[0] == "strata: loading big-model ..."
    assert len(lines) >= 3 and all(line.startswith("strata: loading big-model ... ")
                                   and line.endswith(" s") for line in lines[1:])
    assert "\r" not in stream.getvalue()


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="a terminal's Ctrl-C reaches the "
                    "process group (killpg), which Windows lacks; there Ctrl+Break is another path")
@pytest.mark.slow
def test_ctrl_c_during_the_load_stops_at_once_without_a_traceback(tmp_path):
    try:
        model = default_model_path(fetch=False, progress=False)
    except DefaultModelError as exc:
        pytest.skip(f"the default model is not available: {exc}")
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*server_command(), "serve", "--port", "0", "--device", "cpu"],
            stdout=log, stderr=subprocess.STDOUT, env=server_env(tmp_path),
            start_new_session=True)
    try:
        deadline_s = time.monotonic() + 60
        while "strata: loading" not in log_path.read_text() and time.monotonic() < deadline_s:
            assert process.poll() is None, log_path.read_text()
            time.sleep(0.05)
        text = log_path.read_text()
        assert f"strata: loading {model.stem} (" in text, text
        assert "serving" not in text  # the Ctrl-C lands in the load, not after it
        interrupted_s = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole group
        code = process.wait(timeout=30)
        stopped_s = time.monotonic() - interrupted_s
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)
    text = log_path.read_text()
    assert code == 130, text
    assert stopped_s < 5.0, f"took {stopped_s:.1f} s to stop:\n{text}"
    assert "Traceback" not in text and "serving" not in text, text
