"""Run the real `strata serve` (default model, spawned engine) as a subprocess for black-box tests.

The server binds port 0 and logs its URL; we read the port from that line instead of guessing
a free one, so two test runs on one machine never race for a port.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_URL_LINE = re.compile(r"serving .* at (http://[\d.]+:\d+)/v1")
START_TIMEOUT_S = 180.0  # import + dequantize + tokenizer on a busy 2-core machine
STOP_TIMEOUT_S = 30.0


def server_command() -> list[str]:
    """The installed `strata` console script next to this interpreter, else `python -m`."""
    script = Path(sys.executable).with_name("strata")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "strata.cli"]


def server_env(tmp_dir: Path) -> dict[str, str]:
    """The test's environment plus the real model cache and no user config file."""
    from strata.paths import strata_home

    env = dict(os.environ)
    # The real cache: the default model is already there, so nothing is downloaded.
    env["STRATA_HOME"] = str(strata_home())
    env["STRATA_CONFIG"] = str(tmp_dir / "no-config.toml")  # absent: only flags apply
    env.pop("STRATA_API_KEY", None)  # a key of the developer's own would lock the tests out
    # OpenMP threads spin while waiting for work; on a 2-core machine shared with other jobs
    # that spinning slows every decode step about 10x. Passive waiting costs nothing here.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class ServerProcess:
    """One `strata serve` subprocess: start(), base_url, get_json(), stop(), log_tail()."""

    def __init__(self, tmp_dir: Path, extra_args: tuple[str, ...] = ()):
        self.tmp_dir = tmp_dir
        self.log_path = tmp_dir / "server.log"
        self.extra_args = extra_args
        self.process: subprocess.Popen | None = None
        self.base_url = ""

    def start(self) -> ServerProcess:
        """Spawn the server and wait until it listens with the model loaded."""
        args = [*server_command(), "serve", "--port", "0", "--device", "cpu",
                "--context", "2048", "--snapshot-dir", str(self.tmp_dir / "snapshots"),
                *self.extra_args]
        with open(self.log_path, "wb") as log:
            # Its own session, so a Ctrl-C of pytest reaches us first and we stop it cleanly.
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=server_env(self.tmp_dir),
                start_new_session=True)
        self.base_url = self._wait_for_url()
        self._wait_until_loaded()
        return self

    @contextlib.contextmanager
    def running(self) -> Iterator[ServerProcess]:
        """start(), yield the server, stop(); then the server must have exited cleanly (0)."""
        self.start()
        try:
            yield self
        finally:
            code = self.stop()
        assert code == 0, f"strata serve exited with {code}:\n{self.log_tail()}"

    def _wait_for_url(self) -> str:
        deadline_s = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline_s:
            match = _URL_LINE.search(self.log_path.read_text(errors="replace"))
            if match:
                return match.group(1)
            if self.process.poll() is not None:
                raise RuntimeError(f"strata serve exited with {self.process.returncode} before "
                                   f"listening:\n{self.log_tail()}")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"strata serve did not listen within {START_TIMEOUT_S:.0f} s:\n"
                           f"{self.log_tail()}")

    def _wait_until_loaded(self) -> None:
        deadline_s = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline_s:
            try:
                health = self.get_json("/health")
            except (urllib.error.URLError, OSError):
                health = {}
            if health.get("state") == "loaded":
                return
            time.sleep(0.2)
        raise RuntimeError(f"the engine did not load within {START_TIMEOUT_S:.0f} s:\n"
                           f"{self.log_tail()}")

    def get_json(self, path: str, timeout_s: float = 10.0) -> dict[str, Any]:
        """GET a JSON route (also for 4xx/5xx answers, whose body is JSON too)."""
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read() or b"{}")

    def status(self) -> dict[str, Any]:
        return self.get_json("/v1/status")

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Poll /v1/status until no request runs; returns the last status."""
        deadline_s = time.monotonic() + timeout_s
        status = self.status()
        while status.get("is_busy") and time.monotonic() < deadline_s:
            time.sleep(0.1)
            status = self.status()
        return status

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    def stop(self) -> int | None:
        """SIGTERM (the server stops its engine), then SIGKILL if it hangs. Returns the code."""
        process = self.process
        if process is None or process.poll() is not None:
            return None if process is None else process.returncode
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # its own session: the engine goes too
            process.wait(5)
            raise RuntimeError(f"strata serve ignored SIGTERM for {STOP_TIMEOUT_S:.0f} s:\n"
                               f"{self.log_tail()}") from None
