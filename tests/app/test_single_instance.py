"""A second launch asks the first to show its dashboard."""

from __future__ import annotations

import uuid

from strata.app.single_instance import SingleInstance, ask_running_instance, server_name


def test_second_launch_reaches_the_first(qtbot):
    name = server_name(f"test-{uuid.uuid4()}")
    assert not ask_running_instance(name, timeout_ms=200)
    first = SingleInstance(name)
    assert first.listen()
    with qtbot.waitSignal(first.show_requested, timeout=3000):
        assert ask_running_instance(name)
    first.close()


def test_names_differ_per_config():
    assert server_name("a") != server_name("b")
