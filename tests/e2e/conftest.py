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
    with ServerProcess(tmp_path_factory.mktemp("serve")).running() as process:
        yield process
