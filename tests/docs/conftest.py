"""A live `strata serve` with the default model, for the docs examples.

The server is the first `strata serve` command of getting-started.md, run as a user would run
it, on a free port; STRATA_HOME points at a temporary folder whose models/ links to the real
model cache, so nothing is downloaded twice and no user config file is read.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from doc_examples import read_blocks, split_commands
from docs_server import LiveServer, free_port, strata_script

START_TIMEOUT_S = 480.0


@pytest.fixture(scope="session")
def docs_env(tmp_path_factory) -> dict[str, str]:
    """Environment for every docs command: temporary STRATA_HOME and config, real model cache."""
    from strata.default_model import default_model_path

    model = default_model_path(fetch=True, progress=False)  # once, if never pulled here
    root = tmp_path_factory.mktemp("docs-env")
    (root / "home").mkdir()
    (root / "home" / "models").symlink_to(model.parent, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    env.update(STRATA_HOME=str(root / "home"), STRATA_CONFIG=str(root / "no-config.toml"),
               XDG_CONFIG_HOME=str(root / "config"), TOKENIZERS_PARALLELISM="false")
    return env


def _serve_argv(port: int) -> list[str]:
    serve = next(c for b in read_blocks("getting-started.md") if b.lang == "bash"
                 and b.skip_reason is None for c in split_commands(b)
                 if c.argv[:2] == ("strata", "serve"))
    argv = list(serve.argv[1:])
    if "--port" in argv:
        argv[argv.index("--port") + 1] = str(port)
    else:
        argv += ["--port", str(port)]
    return [strata_script(), *argv]


def _is_healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="session")
def live_server(docs_env, tmp_path_factory) -> Iterator[LiveServer]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("docs-server") / "serve.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(_serve_argv(port), env=docs_env, stdout=log,
                                   stderr=subprocess.STDOUT, cwd=docs_env["STRATA_HOME"])
    server = LiveServer(port, docs_env, log_path)
    deadline_s = time.monotonic() + START_TIMEOUT_S
    try:
        while not _is_healthy(port):
            if process.poll() is not None:
                pytest.fail(f"strata serve exited with {process.returncode}:\n{server.log_tail()}")
            if time.monotonic() > deadline_s:
                pytest.fail(f"strata serve was not healthy after {START_TIMEOUT_S:.0f} s:\n"
                            f"{server.log_tail()}")
            time.sleep(0.5)
        yield server
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
