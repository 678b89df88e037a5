"""Fixtures: the real ThreadServiceHost and bridge, over a fake service."""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("PySide6")

from strata.app.bridge import ServiceBridge
from strata.app.service_host import HostOptions, ThreadServiceHost
from tests.app.fakes import FakeService, factory_for


@pytest.fixture(autouse=True)
def _qt_garbage_goes_with_its_test(qapp):
    """Qt objects a test leaves in reference cycles are freed at its end, with no event being
    dispatched, not by the cyclic GC inside another file's test later in the same worker (a
    CI worker segfaulted in such a collection, stop 48)."""
    yield
    qapp.processEvents()
    gc.collect()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tokenizer directory the fake engine and the real Service accept as a model."""
    from fakes.tiny_model import write_tiny_model_dir

    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def fake_service() -> FakeService:
    return FakeService()


@pytest.fixture
def make_bridge(qtbot, fake_service):
    """make_bridge(rules=..., rules_enabled=...) -> a started bridge; stopped at teardown."""
    bridges = []

    def make(rules=None, rules_enabled=True, service=None) -> ServiceBridge:
        host = ThreadServiceHost(
            factory_for(service or fake_service),
            rules=rules,
            rules_enabled=rules_enabled,
            options=HostOptions(telemetry_interval_s=0.05, rules_interval_s=0.1),
        )
        bridge = ServiceBridge(host)
        bridges.append(bridge)
        bridge.start(settings=None)
        # bool(): waitUntil takes a callback returning None as an assertion that passed
        qtbot.waitUntil(lambda: bool(bridge.last_status.get("endpoint")), timeout=5000)
        return bridge

    yield make
    for bridge in bridges:
        bridge.stop(timeout_s=5)
