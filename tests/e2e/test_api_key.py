"""`strata serve --api-key KEY` (issue 17 item 3): the key works, the server warns that a flag
is visible in the process list, and none of its child processes (engine, standby) carry the key
on their command lines. The real server and default model."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import psutil
import pytest

from strata.default_model import DefaultModelError, default_model_path
from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
KEY = "e2e-secret-4f1c"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory) -> Iterator[ServerProcess]:
    try:
        default_model_path(fetch=True, progress=False)
    except DefaultModelError as exc:
        pytest.skip(f"the default model is not available: {exc}")
    process = ServerProcess(tmp_path_factory.mktemp("serve-key"),
                            extra_args=("--api-key", KEY)).start()
    try:
        yield process
    finally:
        assert process.stop() == 0, process.log_tail()


def _get(server: ServerProcess, path: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(server.base_url + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            json.loads(response.read())
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_key_works_warns_and_stays_off_child_command_lines(keyed_server):
    assert _get(keyed_server, "/v1/models", None) == 401
    assert _get(keyed_server, "/v1/models", "wrong") == 401
    assert _get(keyed_server, "/v1/models", KEY) == 200
    assert "--api-key puts the key in the process list" in keyed_server.log_path.read_text()
    children = psutil.Process(keyed_server.process.pid).children(recursive=True)
    assert children, "the engine process should be running"
    for child in children:
        assert not any(KEY in arg for arg in child.cmdline()), child.cmdline()
