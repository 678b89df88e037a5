"""The tray and the dashboard show a partial expert cache's hits, misses and bytes moved, a
row a MoE layer (issue 54), read from a real CPU engine's status: keys only a fake produced
would show zeros against the real engine (the activity line's lesson)."""

from __future__ import annotations

import pytest

from strata.app import expert_cache_view
from strata.app.dashboard import Dashboard
from strata.app.tray import TrayController
from tests.core.engine_memory_helpers import make_engine, run
from tests.helpers.tiny_models import make_tiny_hf_model

PROMPT = list(range(3, 40))


def engine_experts(model_dir, tmp_path, expert_cache: str) -> dict:
    """The `experts` status of a real CPU engine after one answer, as the service passes it."""
    engine = make_engine(model_dir, tmp_path, expert_cache=expert_cache)
    try:
        run(engine, PROMPT)
        return engine.status()["experts"]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def statuses(tmp_path_factory):
    """(partial, all resident) expert statuses of the tiny Qwen3-MoE (16 experts a layer)."""
    model_dir, _ = make_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("tiny"))
    return (engine_experts(model_dir, tmp_path_factory.mktemp("a"), "10"),
            engine_experts(model_dir, tmp_path_factory.mktemp("b"), "all"))


def test_the_summary_and_rows_read_the_real_engines_counters(statuses) -> None:
    experts, _ = statuses
    layers = experts["layers"]
    assert experts["num_misses"] > 0 and experts["total_experts"] > experts["num_resident"]
    line = expert_cache_view.summary_line({"experts": experts})
    assert line is not None
    hits, misses = experts["num_hits"], experts["num_misses"]
    assert line.startswith(f"Experts: {experts['num_resident']:,} of "
                           f"{experts['total_experts']:,} resident · "
                           f"{100 * hits / (hits + misses):.1f}% hits")
    assert "computed on the CPU" not in line  # cpu_expert_misses is off by default
    rows = expert_cache_view.layer_rows({"experts": experts})
    assert len(rows) == len(layers) > 0
    for row, layer in zip(rows, layers):
        assert row[:3] == (str(layer["layer"]), f"{layer['num_hits']:,}",
                           f"{layer['num_misses']:,}")
    assert sum(int(row[2].replace(",", "")) for row in rows) == misses


def test_nothing_is_shown_without_a_partial_cache(statuses) -> None:
    _, all_resident = statuses
    assert all_resident["is_all_resident"]
    for status in ({"experts": all_resident}, {"experts": None}, {}):
        assert expert_cache_view.summary_line(status) is None
        assert expert_cache_view.layer_rows(status) == []


def test_sizes_and_rates_read_as_a_user_expects() -> None:
    assert expert_cache_view.size_text(442 << 20) == "442 MiB"
    assert expert_cache_view.size_text(3 << 30) == "3.0 GiB"
    assert expert_cache_view.rate_text(0, 0) == "-"
    assert expert_cache_view.rate_text(3, 1) == "75.0%"


def test_the_dashboard_and_the_tray_menu_show_it(qtbot, make_bridge, fake_service,
                                                 statuses) -> None:
    experts, all_resident = statuses
    dashboard = Dashboard(make_bridge())
    qtbot.addWidget(dashboard)
    dashboard.bridge.host.stop(timeout_s=5)  # only the statuses below, no fake polls
    tray = TrayController(dashboard.bridge)
    status = fake_service.status() | {"experts": experts}
    dashboard.apply_status(status)
    tray.apply_status(status)
    line = expert_cache_view.summary_line(status)
    assert not dashboard.experts_box.isHidden() and dashboard.experts_summary.text() == line
    assert dashboard.expert_layers.rowCount() == len(experts["layers"])
    first = expert_cache_view.layer_rows(status)[0]
    assert tuple(dashboard.expert_layers.item(0, c).text() for c in range(len(first))) == first
    assert tray.experts_action.isVisible() and tray.experts_action.text() == line
    status = status | {"experts": all_resident}
    dashboard.apply_status(status)
    tray.apply_status(status)
    assert dashboard.experts_box.isHidden() and not tray.experts_action.isVisible()
