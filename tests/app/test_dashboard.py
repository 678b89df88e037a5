"""The dashboard follows the bridge's signals: chart, processes, levels, countdowns, log."""

from __future__ import annotations

from strata.app.dashboard import Countdown, Dashboard
from strata.engine.service.telemetry import GpuProcess, GpuSnapshot, RamSnapshot

GIB = 1024**3


def gpu_status(fake_service) -> dict:
    status = fake_service.status()
    status["gpu"] = GpuSnapshot(
        "Fake H200",
        80 * GIB,
        50 * GIB,
        30 * GIB,
        (GpuProcess(1234, "blender", 12 * GIB), GpuProcess(99, "python", 15 * GIB)),
    )
    status["endpoint"] = "http://127.0.0.1:5555/v1"
    return status


def test_gpu_readings_fill_chart_table_and_levels(qtbot, make_bridge, fake_service):
    bridge = make_bridge()
    dashboard = Dashboard(bridge)
    qtbot.addWidget(dashboard)
    bridge.on_status(gpu_status(fake_service))  # as the host would, from its thread
    qtbot.waitUntil(lambda: dashboard.mode == "gpu")
    samples = [v for _, v in dashboard.chart.samples]
    # weights, experts, kv, other processes (used minus ours), free
    assert samples[-1] == (4 * GIB, 10 * GIB, GIB, 15 * GIB, 50 * GIB)
    assert dashboard.processes.rowCount() == 2
    assert dashboard.processes.item(0, 1).text() == "blender"
    assert dashboard.processes.item(0, 2).text() == "12,288 MiB"
    assert dashboard.level_buttons["experts"].text() == "Release experts (frees 10.0 GiB)"
    assert dashboard.level_buttons["sleep"].text() == "Sleep (frees 15.0 GiB)"
    assert dashboard.activity.text() == (
        "last request 42.5 tok/s · queue 2 · 128 of 300 prompt tokens from cache")
    assert dashboard.level_labels["weights"].text() == "resident · 4.0 GiB in VRAM · 0.0 GiB released"
    dashboard.resize(800, 700)
    assert not dashboard.chart.grab().isNull()  # paints without error


def test_without_a_gpu_it_says_so_and_shows_ram(qtbot, make_bridge):
    bridge = make_bridge()  # the real telemetry: this test machine has no NVIDIA GPU
    dashboard = Dashboard(bridge)
    qtbot.addWidget(dashboard)
    qtbot.waitUntil(lambda: dashboard.mode != "", timeout=5000)
    if bridge.last_status.get("gpu") is not None:  # pragma: no cover - on a GPU machine
        assert dashboard.mode == "gpu"
        return
    assert dashboard.mode == "ram"
    assert "showing RAM" in dashboard.chart_note.text()
    assert dashboard.processes.isHidden()
    ram = bridge.last_status["ram"]
    assert isinstance(ram, RamSnapshot) and ram.strata_bytes > 0
    assert dashboard.chart.series[0][0] == "Strata (RSS)"


def test_a_level_button_sends_its_action(qtbot, make_bridge, fake_service):
    bridge = make_bridge()
    dashboard = Dashboard(bridge)
    qtbot.addWidget(dashboard)
    qtbot.waitUntil(dashboard.level_buttons["offload"].isEnabled)
    dashboard.level_buttons["offload"].click()
    qtbot.waitUntil(lambda: fake_service.calls == ["offload_session"])
    qtbot.waitUntil(lambda: "Offloaded the session" in dashboard.log.toPlainText())


def test_countdowns_tick_between_updates(qtbot, make_bridge, fake_service):
    bridge = make_bridge()
    dashboard = Dashboard(bridge)
    qtbot.addWidget(dashboard)
    fake_service.idle["sleep"] = 2.0  # the host publishes it on its next poll
    bar = dashboard.countdowns["sleep"]
    qtbot.waitUntil(lambda: bar.remaining_s is not None)
    fake_service.idle["sleep"] = None
    bridge.host.stop(timeout_s=5)  # no more updates: what moves now is the local tick
    first = bar.value()
    qtbot.waitUntil(lambda: bar.value() < first, timeout=3000)
    assert bar.format().startswith("Sleep in 0:0")
    assert dashboard.countdowns["unload"].format() == "Unload: off"


def test_countdown_restarts_its_scale_when_the_timer_resets(qtbot):
    bar = Countdown("Sleep")
    bar.set_remaining(100.0)
    bar.set_remaining(50.0)
    assert 490 <= bar.value() <= 500
    bar.set_remaining(300.0)  # a request reset the timer
    assert bar.value() >= 995
    bar.set_remaining(None)
    assert bar.format() == "Sleep: off"


def test_activity_reads_what_the_real_service_reports(qtbot, make_bridge, tiny_model_dir):
    # The real Service, its fake engine in a real engine process: the activity line showed
    # 0 tok/s for every real status, since it read keys only the tray's fake produced.
    import asyncio

    from fakes.services import answer, make_service

    async def served_status() -> dict:
        service = make_service(tiny_model_dir, engine={"token_delay_s": 0.01})
        await service.start()
        try:
            await answer(service, [5, 6, 7], max_tokens=5)
            await answer(service, [5, 6, 7, 8], max_tokens=5)  # reuses the first's prefix
            return service.status()
        finally:
            await service.stop()

    status = asyncio.run(served_status())
    counters = status["counters"]
    assert counters["tokens_per_second"] > 0 and counters["cached_tokens_total"] > 0
    dashboard = Dashboard(make_bridge())
    qtbot.addWidget(dashboard)
    dashboard.bridge.host.stop(timeout_s=5)  # only the real status below, no fake polls
    dashboard.apply_status(status)
    assert dashboard.activity.text() == (
        f"last request {counters['tokens_per_second']:.1f} tok/s · queue 0 · "
        f"{counters['cached_tokens_total']} of {counters['prompt_tokens_total']} prompt "
        "tokens from cache")


def test_on_the_cpu_the_levels_and_menu_say_ram(qtbot, make_bridge, fake_service):
    from strata.app.tray import TrayController

    fake_service.memory_kind = "RAM"  # what the real service reports for a CPU engine
    bridge = make_bridge()
    dashboard, tray = Dashboard(bridge), TrayController(bridge)
    qtbot.addWidget(dashboard)
    qtbot.waitUntil(lambda: bridge.last_status.get("memory_kind") == "RAM")
    assert dashboard.level_labels["weights"].text() == "resident · 4.0 GiB in RAM · 0.0 GiB released"
    assert tray.status_action.text().startswith("Serving · 15.0 GiB RAM")
    assert "15.0 GiB held in RAM" in tray.tray.toolTip()
    assert "VRAM" not in tray.status_action.text() + tray.tray.toolTip()


def test_an_idle_action_is_logged_and_its_timer_says_when_it_runs_again(
        qtbot, make_bridge, fake_service):
    fake_service.idle_timeouts["sleep"] = 300.0
    fake_service.idle["sleep"] = 120.0
    bridge = make_bridge()
    dashboard = Dashboard(bridge)
    qtbot.addWidget(dashboard)
    bar = dashboard.countdowns["sleep"]
    qtbot.waitUntil(lambda: bar.format().startswith("Sleep in "))
    fake_service.fire_idle("sleep", "sleep", 300.0)  # as the lifecycle does, on its loop
    qtbot.waitUntil(lambda: "idle for 300 s: slept" in dashboard.log.toPlainText())
    qtbot.waitUntil(lambda: bar.format().startswith("Sleep: done 0:0"))
    assert bar.format().endswith(" ago · again 5:00 after the next request")
    assert dashboard.countdowns["unload"].format() == "Unload: off"
    fake_service.idle_fired.clear()  # a request ended: the clock runs, others wait for it
    fake_service.idle_timeouts["unload"] = 600.0
    qtbot.waitUntil(lambda: dashboard.countdowns["unload"].format()
                    == "Unload: waits for the next request, then 10:00")
