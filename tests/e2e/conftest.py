"""One real `strata serve` per test module, on the default model from the real cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from strata.default_model import DefaultModelError, default_model_path
from tests.e2e.server import ServerProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    """A started server; stopped at the end of the module, which must exit cleanly (code 0)."""
    try:
        default_model_path(fetch=True, progress=False)  # normally cached: no network
    except DefaultModelError as exc:
        pytest.skip(f"the default model is not available: {exc}")
    process = ServerProcess(tmp_path_factory.mktemp("serve")).start()
    try:
        yield process
    finally:
        code = process.stop()
    assert code == 0, f"strata serve exited with {code}:\n{process.log_tail()}"
