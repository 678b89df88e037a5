"""Autostart at login: the XDG .desktop entry (Linux)."""

from __future__ import annotations

import shlex
import sys

import pytest

from strata.app import autostart

pytestmark = pytest.mark.skipif(
    sys.platform in ("win32", "darwin"), reason="XDG autostart is Linux"
)


def test_enable_disable(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert not autostart.is_autostart_enabled()
    autostart.set_autostart(True, ["/opt/my apps/python", "-m", "strata.app.main", "--port", "0"])
    text = (tmp_path / "autostart" / "strata-tray.desktop").read_text()
    exec_line = next(line for line in text.splitlines() if line.startswith("Exec="))
    assert shlex.split(exec_line[5:]) == [
        "/opt/my apps/python",
        "-m",
        "strata.app.main",
        "--port",
        "0",
    ]
    assert autostart.is_autostart_enabled()
    autostart.set_autostart(False)
    assert not autostart.is_autostart_enabled()
    autostart.set_autostart(False)  # already off: no error


def test_unwritable_folder_gives_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocker))  # a file where a folder must go
    with pytest.raises(autostart.AutostartError, match="could not change autostart entry"):
        autostart.set_autostart(True, ["strata-tray"])


def test_launch_command_runs_the_tray():
    command = autostart.launch_command()
    assert command[0].endswith("strata-tray") or command[1:] == ["-m", "strata.app.main"]
