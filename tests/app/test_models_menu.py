"""The tray's Models menu and the dashboard's model table, over the real ThreadServiceHost and
bridge with the fake pool (tests/app/fakes.py, checked against the real pool in
test_pool_shape.py): states, the default's check, load/wake/unload per model."""

from __future__ import annotations

from strata.app.dashboard import Dashboard
from strata.app.models_view import budget_text, model_views
from strata.app.tray import TrayController
from tests.app.fakes import GIB, FakePool, model_row

LIBRARY = ("qwen-0.5b", "embed-small")


def pool(**options) -> FakePool:
    return FakePool(library=LIBRARY, **options)


def titles(tray: TrayController) -> dict[str, str]:
    return {name: entry.menu.title() for name, entry in tray.models_menu.entries.items()}


def test_the_menu_lists_every_model_with_its_state_and_checks_the_default(qtbot, make_bridge):
    tray = TrayController(make_bridge(service=pool()))
    qtbot.waitUntil(lambda: len(tray.models_menu.entries) == 3)
    assert list(tray.models_menu.entries) == ["tiny-moe", *LIBRARY]  # the default first
    assert titles(tray) == {"tiny-moe": "tiny-moe — Serving · 15.0 GiB",
                            "qwen-0.5b": "qwen-0.5b — Available",
                            "embed-small": "embed-small — Available"}
    checked = {name for name, entry in tray.models_menu.entries.items()
               if entry.menu.menuAction().isChecked()}
    assert checked == {"tiny-moe"}
    assert not tray.models_menu.empty_action.isVisible()
    # the Models submenu is in the tray's menu, under the status line
    assert tray.menu.actions()[1] is tray.models_menu.menuAction()


def test_load_and_unload_reach_the_service_with_the_model(qtbot, make_bridge):
    service = pool()
    tray = TrayController(make_bridge(service=service))
    qtbot.waitUntil(lambda: "qwen-0.5b" in tray.models_menu.entries)
    qwen = tray.models_menu.entries["qwen-0.5b"]
    assert (qwen.up.text(), qwen.up.isEnabled(), qwen.down.isEnabled()) == ("Load", True, False)
    qwen.up.trigger()
    qtbot.waitUntil(lambda: qwen.menu.title() == "qwen-0.5b — Serving · 1.0 GiB")
    assert service.call_options[-1] == {"model": "qwen-0.5b"}
    assert (qwen.up.isEnabled(), qwen.down.isEnabled()) == (False, True)
    assert qwen.up.toolTip() == "qwen-0.5b is loaded"
    qwen.down.trigger()
    qtbot.waitUntil(lambda: qwen.menu.title() == "qwen-0.5b — Unloaded")
    assert service.calls[-2:] == ["load", "unload"]
    assert service.status()["state"] == "loaded"  # the default model was left alone


def test_a_sleeping_model_offers_wake(qtbot, make_bridge):
    service = pool()
    service.rows["qwen-0.5b"].update(state="sleeping")
    tray = TrayController(make_bridge(service=service))
    qtbot.waitUntil(lambda: "qwen-0.5b" in tray.models_menu.entries)
    qwen = tray.models_menu.entries["qwen-0.5b"]
    qtbot.waitUntil(lambda: qwen.up.text() == "Wake")
    assert qwen.menu.title() == "qwen-0.5b — Sleeping"
    qwen.up.trigger()
    qtbot.waitUntil(lambda: service.rows["qwen-0.5b"]["state"] == "loaded")
    assert service.call_options[-1] == {"model": "qwen-0.5b"} and service.calls[-1] == "wake"


def test_a_status_tick_keeps_the_menus_and_a_new_model_rebuilds_them(qtbot, make_bridge):
    service = pool()
    bridge = make_bridge(service=service)
    tray = TrayController(bridge)
    qtbot.waitUntil(lambda: len(tray.models_menu.entries) == 3)
    menus = {name: entry.menu for name, entry in tray.models_menu.entries.items()}
    tray.apply_status(bridge.last_status)
    assert {n: e.menu for n, e in tray.models_menu.entries.items()} == menus  # same widgets
    service.rows["llama-1b"] = model_row("llama-1b", is_downloaded=True)
    bridge.host.call("load", model="embed-small")  # any change publishes a status
    qtbot.waitUntil(lambda: "llama-1b" in tray.models_menu.entries)
    assert titles(tray)["embed-small"] == "embed-small — Serving · 1.0 GiB"


def test_a_single_model_service_or_a_failed_start_shows_no_models(qtbot, make_bridge):
    tray = TrayController(make_bridge())  # a plain Service: no pool keys
    assert tray.models_menu.entries == {}
    assert tray.models_menu.empty_action.isVisible()
    tray.apply_status({"state": "failed", "last_error": "no model"})  # the host's own status
    assert tray.models_menu.entries == {}


def test_the_dashboard_table_shows_state_vram_and_the_budget(qtbot, make_bridge):
    service = pool()
    service.vram_budget_bytes = 20 * GIB
    service.rows["embed-small"].update(is_downloaded=False)
    bridge = make_bridge(service=service)
    dashboard = Dashboard(bridge)
    qtbot.addWidget(dashboard)
    qtbot.waitUntil(lambda: dashboard.models.rowCount() == 3)
    table = [[dashboard.models.item(r, c).text() for c in range(5)] for r in range(3)]
    assert table == [
        ["tiny-moe (default)", "Serving", "15.0 GiB", "0.5 GiB", "1 s ago"],
        ["qwen-0.5b", "Available", "0.0 GiB", "0.5 GiB", "never"],
        ["embed-small", "Available", "0.0 GiB", "not downloaded", "never"],
    ]
    assert dashboard.models_budget.text() == "Models hold 15.0 GiB · budget 20.0 GiB"
    assert dashboard.models.horizontalHeaderItem(2).text() == "VRAM"  # "RAM" on the CPU
    bridge.request("load", model="qwen-0.5b")
    qtbot.waitUntil(lambda: dashboard.models.item(1, 1).text() == "Serving")
    assert dashboard.models.item(1, 2).text() == "1.0 GiB"
    assert dashboard.models_budget.text() == "Models hold 16.0 GiB · budget 20.0 GiB"
    assert not dashboard.models_box.isHidden()
    service.vram_budget_bytes = 0
    bridge.request("unload", model="qwen-0.5b")
    qtbot.waitUntil(lambda: dashboard.models_budget.text() ==
                    "Models hold 15.0 GiB · budget: the free VRAM")


def test_the_budget_line_on_the_cpu():
    status = {"models": [model_row("a", vram_bytes=GIB)], "vram_budget_bytes": 0,
              "memory_kind": "RAM"}
    assert budget_text(status) == "Models hold 1.0 GiB · no budget"


def test_the_dashboard_hides_the_table_without_a_pool(qtbot, make_bridge):
    dashboard = Dashboard(make_bridge())
    qtbot.addWidget(dashboard)
    assert dashboard.models_box.isHidden()


def test_views_for_every_state_the_pool_reports():
    states = ("available", "loading", "loaded", "busy", "experts_released",
              "session_offloaded", "waking", "sleeping", "unloaded", "waiting_for_vram",
              "failed")
    status = {"models": [model_row(f"m-{s}", state=s) for s in states]}
    views = {v.name.removeprefix("m-"): v for v in model_views(status)}
    up = {state: (v.up.label, v.up.is_enabled, v.down.is_enabled) for state, v in views.items()}
    assert up == {
        "available": ("Load", True, False), "loading": ("Load", False, False),
        "loaded": ("Load", False, True), "busy": ("Load", False, True),
        "experts_released": ("Load", False, True), "session_offloaded": ("Load", False, True),
        "waking": ("Load", False, False), "sleeping": ("Wake", True, True),
        "unloaded": ("Load", True, False), "waiting_for_vram": ("Load", True, False),
        "failed": ("Load", True, False),
    }
