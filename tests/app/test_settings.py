"""Settings round-trip through the config file that `strata serve` reads."""

from __future__ import annotations

import tomllib

import pytest
from PySide6.QtWidgets import QLabel

from strata.app.rules_editor import COLUMNS
from strata.app.settings_window import SettingsWindow
from strata.engine.service.rules import PRESETS, Rule, rules_from_config
from strata.engine.service.settings import load_settings

MIB = 1024**2


@pytest.fixture(autouse=True)
def private_autostart(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def test_settings_round_trip(qtbot, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(
        'port = 9000\nsleep-idle = 120\ndevice = "cpu"\n'
        '[[rules]]\npreset = "blender"\n[tray]\nrules_enabled = false\n'
    )
    window = SettingsWindow(config)
    qtbot.addWidget(window)
    window.load()
    assert window.port.value() == 9000
    assert window.idle["sleep_idle_s"].value() == 120
    assert not window.rules_enabled.isChecked()
    assert window.rules_editor.table.rowCount() == 1
    window.model.setText(str(tmp_path / "model.gguf"))
    window.port.setValue(8123)
    window.api_key.setText('s3cret "quoted"')
    window.idle["sleep_idle_s"].setValue(0)  # off: the key goes away
    window.idle["idle_unload_s"].setValue(3600)
    window.min_free_vram_mib.setValue(2048)
    window.before_load.setText('curl -X POST http://127.0.0.1:8188/free -d "{}"')
    window.snapshot_ram_mib.setValue(512)
    window.rules_enabled.setChecked(True)
    window.rules_editor.add_rule(PRESETS["comfyui"])
    with qtbot.waitSignal(window.saved) as saved:
        assert window.save(), window.message.text()
    assert {
        "model",
        "port",
        "api_key",
        "sleep_idle_s",
        "idle_unload_s",
        "rules",
        "rules_enabled",
    } <= saved.args[0]
    raw = tomllib.loads(config.read_text())
    assert "sleep_idle_s" not in raw and "sleep-idle" not in raw
    settings = load_settings(config, {})  # what `strata serve` will run with
    assert settings.port == 8123 and settings.api_key == 's3cret "quoted"'
    assert settings.device == "cpu"  # a key the window does not show survives
    assert settings.idle_unload_s == 3600 and settings.sleep_idle_s is None
    assert settings.min_free_vram_mib == 2048 and settings.snapshot_ram_budget_bytes == 512 * MIB
    assert settings.before_load_argv[-1] == "{}"
    rules = rules_from_config(raw["rules"])
    assert [r.name for r in rules] == ["Blender", "ComfyUI"] and rules[1] == PRESETS["comfyui"]
    assert raw["tray"]["rules_enabled"] is True
    again = SettingsWindow(config)
    qtbot.addWidget(again)
    again.load()
    assert again.server_values() == window.server_values()
    assert again.rules_editor.rules() == window.rules_editor.rules()
    assert window.message.text() == (
        f"Saved to {config}. Model, Port, API key, Sleep after idle, Unload after idle, "
        "VRAM guard: wait for free, Before-load command, Snapshot RAM budget: takes effect "
        "when the server restarts.")
    assert window.restart_button.isVisibleTo(window)


def test_a_bad_rule_row_is_refused_and_the_file_kept(qtbot, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("port = 9000\n")
    window = SettingsWindow(config)
    qtbot.addWidget(window)
    window.load()
    window.rules_editor.add_rule(PRESETS["steam"])
    window.rules_editor.table.item(0, 3).setText("")  # a process rule without a pattern
    assert not window.save()
    assert "needs a pattern" in window.message.text()
    assert config.read_text() == "port = 9000\n"


def test_autostart_toggle_writes_the_desktop_entry(qtbot, tmp_path):
    config = tmp_path / "config.toml"
    window = SettingsWindow(config)
    qtbot.addWidget(window)
    window.load()
    assert not window.autostart.isChecked()
    window.autostart.setChecked(True)
    assert window.save()
    entry = tmp_path / "xdg" / "autostart" / "strata-tray.desktop"
    assert "Exec=" in entry.read_text()
    window.autostart.setChecked(False)
    assert window.save()
    assert not entry.exists()


def test_the_rules_editor_keeps_the_match_mode_and_a_gpu_rules_ignore_list(qtbot, tmp_path):
    from strata.engine.service.rules import Rule, RuleConfigError

    window = SettingsWindow(tmp_path / "config.toml")
    qtbot.addWidget(window)
    window.load()
    loose = Rule("by argument", "process", "sleep", "restore", ("*--my-flag*",), match="cmdline")
    gpu = Rule("any", "gpu_process", "release_experts", "wait", ignore=("Xorg", "kwin*"))
    shrink = Rule("game", "process", "shrink_experts", "restore", ("*/steamapps/common/*",),
                  keep_free_mib=8192)
    window.rules_editor.set_rules([loose, gpu, PRESETS["comfyui"], shrink])
    assert window.rules_editor.table.item(1, 3).text() == "Xorg, kwin*"
    assert window.rules_editor.rules() == [loose, gpu, PRESETS["comfyui"], shrink]
    window.rules_editor.table.item(3, 7).setText("lots")
    with pytest.raises(RuleConfigError, match="whole number of MiB"):
        window.rules_editor.rules()


def test_a_save_writes_only_what_differs_from_the_defaults(qtbot, tmp_path):
    config = tmp_path / "config.toml"  # a first run: no file yet
    window = SettingsWindow(config)
    qtbot.addWidget(window)
    window.load()
    texts = [label.text() for label in window.findChildren(QLabel)]
    assert not any(text.startswith("Saved") for text in texts)  # nothing is saved yet
    assert f"Config file: {config}" in texts
    window.idle["sleep_idle_s"].setValue(120)
    assert window.save(), window.message.text()
    assert tomllib.loads(config.read_text()) == {"sleep_idle_s": 120.0}
    assert window.message.text() == (
        f"Saved to {config}. Sleep after idle: takes effect when the server restarts.")


def test_saving_unchanged_settings_asks_for_no_restart(qtbot, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('port = 9000\nsleep-idle = 120\n')
    window = SettingsWindow(config)
    qtbot.addWidget(window)
    window.load()
    assert window.save(), window.message.text()
    assert window.message.text() == f"Saved to {config} and applied."
    assert not window.restart_button.isVisibleTo(window)
    assert tomllib.loads(config.read_text()) == {"port": 9000, "sleep_idle_s": 120.0}
    window.port.setValue(8080)  # back to the default: the key goes away
    assert window.save()
    assert tomllib.loads(config.read_text()) == {"sleep_idle_s": 120.0}
    assert window.message.text().endswith(". Port: takes effect when the server restarts.")


def test_the_running_port_is_shown_next_to_the_configured_one(qtbot, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("port = 8123\n")
    endpoint = "http://127.0.0.1:9000/v1"  # e.g. strata-tray --port 9000
    window = SettingsWindow(config, running_endpoint=lambda: endpoint)
    qtbot.addWidget(window)
    window.load()
    assert window.port.value() == 8123
    assert window.port_note.text() == f"running now at {endpoint}"


def test_the_rules_table_shows_each_trigger_whole(qtbot, tmp_path):
    window = SettingsWindow(tmp_path / "config.toml")
    qtbot.addWidget(window)
    window.load()
    editor = window.rules_editor
    editor.add_rule(Rule("big", "process_vram", "sleep", "restore", threshold_gib=8))
    window.show()
    for column in (2, 4, 5):  # the combo boxes
        needed = editor.table.cellWidget(0, column).sizeHint().width()
        assert editor.table.columnWidth(column) >= needed, COLUMNS[column]


def test_an_idle_timer_the_server_runs_with_is_shown_where_the_file_says_off(qtbot, tmp_path):
    """The tray counted a sleep timer down (started with --sleep-idle 60) while Settings read
    the file and showed "off" (issue 51, item 21)."""
    from strata.engine.service.settings import ServeSettings

    config = tmp_path / "config.toml"
    config.write_text("session-offload-idle = 30\n")
    running = ServeSettings(sleep_idle_s=60.0, session_offload_idle_s=30.0)
    window = SettingsWindow(config, running_settings=lambda: running)
    qtbot.addWidget(window)
    window.load()
    assert window.sleep_idle_s.value() == 0  # the file's value, shown as "off"
    assert window.idle_notes["sleep_idle_s"].text() == "running now: 60 s"
    assert window.idle_notes["session_offload_idle_s"].text() == ""  # the same: no note
    stopped = SettingsWindow(config, running_settings=lambda: None)
    qtbot.addWidget(stopped)
    stopped.load()
    assert stopped.idle_notes["sleep_idle_s"].text() == ""
