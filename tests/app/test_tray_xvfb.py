"""The real `strata-tray` process on a virtual X display with a system tray (Xvfb + trayer).

Model: $STRATA_TRAY_TEST_MODEL, else the default model if `strata pull` has cached it; without
either the tray must come up in its error state, which is checked instead. Screenshots of the
tray menu and the dashboard go to test-artifacts/.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import psutil
import pytest

BINARIES = ("Xvfb", "trayer", "xdotool")
pytestmark = pytest.mark.skipif(
    any(shutil.which(b) is None for b in BINARIES),
    reason="needs Xvfb, trayer and xdotool (apt-get install xvfb trayer xdotool)",
)
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


def tray_command() -> list[str]:
    script = Path(sys.executable).with_name("strata-tray")
    return [str(script)] if script.exists() else [sys.executable, "-m", "strata.app.main"]


def test_model() -> str | None:
    if os.environ.get("STRATA_TRAY_TEST_MODEL"):
        return os.environ["STRATA_TRAY_TEST_MODEL"]
    from strata.default_model import default_model_path

    try:
        return str(default_model_path(fetch=False))
    except Exception:  # noqa: BLE001 - no default model, whatever the reason: the test skips
        return None


test_model.__test__ = False  # a helper, not a test


def free_display() -> int:
    for number in range(60, 160):
        if (
            not Path(f"/tmp/.X11-unix/X{number}").exists()
            and not Path(f"/tmp/.X{number}-lock").exists()
        ):
            return number
    pytest.skip("no free X display number")


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def icon_window_of(pid: int, env: dict) -> str:
    """`xdotool getwindowgeometry` of the X window of class strata owned by pid ('' if none)."""
    ids = subprocess.run(
        ["xdotool", "search", "--class", "strata"], env=env, capture_output=True, text=True
    ).stdout.split()
    for window in ids:
        owner = subprocess.run(
            ["xdotool", "getwindowpid", window], env=env, capture_output=True, text=True
        )
        if owner.stdout.strip() == str(pid):
            return subprocess.run(
                ["xdotool", "getwindowgeometry", window], env=env, capture_output=True, text=True
            ).stdout
    return ""


@pytest.fixture
def x_display(tmp_path):
    number = free_display()
    xvfb = subprocess.Popen(
        ["Xvfb", f":{number}", "-screen", "0", "1024x768x24", "-nolisten", "tcp"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {**os.environ, "DISPLAY": f":{number}"}
    wait_for(lambda: Path(f"/tmp/.X11-unix/X{number}").exists(), 10, "Xvfb")
    trayer = subprocess.Popen(
        [
            "trayer",
            "--edge",
            "top",
            "--align",
            "right",
            "--widthtype",
            "pixel",
            "--width",
            "120",
            "--height",
            "24",
            "--transparent",
            "false",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # trayer must own the tray selection before the app asks for it
    yield env
    for proc in (trayer, xvfb):
        proc.terminate()
        proc.wait(10)


def test_real_tray_shows_icon_menu_and_dashboard(x_display, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    art = tmp_path / "art"
    ready = tmp_path / "ready.json"
    model = test_model()
    env = {
        **x_display,
        "QT_QPA_PLATFORM": "xcb",
        "STRATA_CONFIG": str(tmp_path / "config.toml"),
        "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
    }
    args = ["--port", "0", "--device", "cpu", "--model", model or str(tmp_path / "missing.gguf")]
    log_file = open(tmp_path / "tray.log", "w")  # noqa: SIM115 - the tray writes it until the end
    tray = subprocess.Popen(
        [*tray_command(), *args, "--ready-file", str(ready), "--artifacts-dir", str(art)],
        env=env,
        stdout=log_file,
        stderr=subprocess.STDOUT,
    )
    try:
        report = wait_for(
            lambda: (
                read_json(ready).get("tray_visible")
                and read_json(ready).get("state") not in (None, "starting")
                and read_json(ready)
            ),
            120,
            "the tray icon",
        )
        assert report["tray_available"] is True
        # The X server itself must see the tray's window (not just the app's own report).
        x, y, w, h = report["tray_geometry"]
        assert f"Position: {x},{y}" in icon_window_of(tray.pid, env), (
            "no tray icon window on the X server"
        )
        if model:
            report = wait_for(
                lambda: read_json(ready).get("icon") == "serving" and read_json(ready),
                120,
                "the model to load",
            )
            with urllib.request.urlopen(
                report["endpoint"].removesuffix("/v1") + "/health", timeout=10
            ) as r:
                assert r.status == 200  # the tray hosts the real HTTP endpoint
            if importlib.util.find_spec("strata.engine.service.model_pool"):
                # the pool's library in the Models menu: the default model first, serving
                models = wait_for(lambda: read_json(ready).get("models_menu"), 20, "models")
                assert models[0].startswith(f"{Path(model).stem} — Serving"), models
        else:
            assert report["icon"] == "error" and "missing.gguf" in report["last_error"]
        # Right-click the icon where the tray says it is: the menu pops up and is captured.
        subprocess.run(
            ["xdotool", "mousemove", str(x + w // 2), str(y + h // 2), "click", "3"],
            env=env,
            check=True,
        )
        wait_for(lambda: (art / "tray-menu.png").exists(), 20, "the tray menu")
        # A second launch asks the first to show its dashboard, then exits.
        second = subprocess.run(
            [*tray_command(), *args], env=env, capture_output=True, text=True, timeout=60
        )
        assert second.returncode == 0 and "already running" in second.stderr
        wait_for(lambda: read_json(ready).get("dashboard_visible"), 20, "the dashboard")
        wait_for(lambda: (art / "dashboard.png").exists(), 20, "the dashboard screenshot")
        shots = ["tray-menu.png", "screen-with-menu.png", "dashboard.png"]
        if model:
            # A chat client on the tray's endpoint, while the dashboard watches the level move.
            client = openai.OpenAI(base_url=report["endpoint"], api_key="none", timeout=120)
            answer = client.chat.completions.create(
                model="default", temperature=0, max_tokens=16,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
            )
            assert "Paris" in answer.choices[0].message.content
            base = report["endpoint"].removesuffix("/v1")
            request = urllib.request.Request(base + "/sleep", data=b"{}", method="POST",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as r:
                assert r.status == 200
            wait_for(lambda: read_json(ready).get("icon") == "sleeping", 30, "the sleeping icon")
            wait_for(lambda: (art / "dashboard-sleeping.png").exists(), 20, "the sleep picture")
            again = client.chat.completions.create(
                model="default", temperature=0, max_tokens=16,
                messages=[{"role": "user", "content": "What is the capital of France?"}],
            )
            assert again.choices[0].message.content == answer.choices[0].message.content
            wait_for(lambda: read_json(ready).get("icon") == "serving", 30, "serving again")
            shots.append("dashboard-sleeping.png")
        for name in shots:
            assert (art / name).stat().st_size > 1000
            shutil.copy(art / name, ARTIFACTS / name)
        # Quit stops the engine cleanly: the process exits 0 and leaves no engine child behind.
        children = psutil.Process(tray.pid).children(recursive=True)
        if model:
            assert children, "the engine process should run while the model is loaded"
        tray.send_signal(signal.SIGTERM)
        assert tray.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"engine processes left behind: {alive}"
    finally:
        if tray.poll() is None:
            tray.kill()
            tray.wait()
        log_file.close()
        shutil.copy(tmp_path / "tray.log", ARTIFACTS / "tray.log")
