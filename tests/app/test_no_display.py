"""`strata-tray` where there is no display: one line that says so, exit 1 (issue #17 item 22).
Qt's xcb plugin used to abort (SIGABRT) with a misleading message about missing plugins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from strata.app.main import missing_display_reason


def tray_command() -> list[str]:
    script = Path(sys.executable).with_name("strata-tray")
    return [str(script)] if script.exists() else [sys.executable, "-m", "strata.app.main"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="DISPLAY is Linux's")
def test_strata_tray_without_a_display_says_so_and_exits_1(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    env["STRATA_CONFIG"] = str(tmp_path / "none.toml")
    done = subprocess.run(tray_command(), capture_output=True, text=True, env=env, timeout=60,
                          check=False)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [(
        "strata-tray: no display: neither DISPLAY nor WAYLAND_DISPLAY is set; start it from a "
        "desktop session, or run `strata serve` for the server without a tray")]


@pytest.mark.parametrize("environ, platform, has_display", [
    ({}, "linux", False),
    ({"DISPLAY": ":0"}, "linux", True),
    ({"WAYLAND_DISPLAY": "wayland-0"}, "linux", True),
    ({"QT_QPA_PLATFORM": "offscreen"}, "linux", True),  # needs no display
    ({"QT_QPA_PLATFORM": "xcb"}, "linux", False),
    ({}, "win32", True),
    ({}, "darwin", True),
])
def test_which_environments_have_a_display(environ, platform, has_display):
    assert (missing_display_reason(environ, platform) is None) == has_display
