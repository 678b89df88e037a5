"""Every tray window fits a small screen: 1280x720 at 100% and 1920x1080 at 150% (the same
1280x720 logical pixels), under a real X server (Xvfb). Settings was once 1569 px wide, its
Save and Close buttons off-screen on such laptops (issue 51, item 18)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("Xvfb") is None,
                                reason="needs Xvfb (apt-get install xvfb)")
ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("window_fit_probe.py")
TITLE_BAR_PX = 48  # what a window manager may add above the client area


def free_display() -> int:
    for number in range(160, 260):
        if not Path(f"/tmp/.X11-unix/X{number}").exists() and not Path(
                f"/tmp/.X{number}-lock").exists():
            return number
    pytest.skip("no free X display number")


@pytest.fixture(params=[("1280x720", "1"), ("1920x1080", "1.5")], ids=["720p-100", "1080p-150"])
def screen_report(request, tmp_path) -> dict:
    size, scale = request.param
    number = free_display()
    xvfb = subprocess.Popen(["Xvfb", f":{number}", "-screen", "0", f"{size}x24", "-nolisten",
                             "tcp"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/tmp/.X11-unix/X{number}").exists():
            assert time.monotonic() < deadline, "Xvfb did not start"
            time.sleep(0.1)
        env = {**os.environ, "DISPLAY": f":{number}", "QT_QPA_PLATFORM": "xcb",
               "QT_SCALE_FACTOR": scale, "PYTHONPATH": str(ROOT),
               "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
        done = subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        xvfb.terminate()
        xvfb.wait(10)


def inside(r: list[int], area: list[int]) -> bool:
    x, y, w, h = r
    ax, ay, aw, ah = area
    return ax <= x and ay <= y and x + w <= ax + aw and y + h <= ay + ah


def test_every_window_and_its_buttons_fit_the_screen(screen_report):
    area = screen_report["available"]
    assert area[2:] == [1280, 720]  # both screens are 1280x720 logical pixels
    windows = {k: v for k, v in screen_report.items() if isinstance(v, dict)}
    assert {"settings:Server", "settings:Rules", "settings:Models", "dashboard"} <= set(windows)
    for name, window in windows.items():
        min_w, min_h = window["min_hint"]
        assert min_w <= area[2] and min_h + TITLE_BAR_PX <= area[3], (name, window["min_hint"])
        assert window["frame"][2] <= area[2] and window["frame"][3] + TITLE_BAR_PX <= area[3], (
            name, window["frame"])
        assert inside(window["frame"], area), (name, window["frame"])
        for text, button in window["buttons"].items():
            assert inside(button, area), (name, text, button)
    for tab in ("Server", "Rules", "Models"):
        assert {"Save", "Close"} <= set(windows[f"settings:{tab}"]["buttons"])
