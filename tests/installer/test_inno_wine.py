"""strata.iss compiled with Inno Setup's ISCC and the setup run silently, both under wine.

What this runs for real: ISCC on the script; the setup's [Code]: the disk check, the steps and
their order, the settings they give uv (a private Python and cache under the install folder,
the pins as constraints), the failure path (exit code 7, the reason and the log's path), the
upgrade's stop of a running Strata, the uninstall step; its file, shortcut, login entry and
uninstall-key handling, its silent exit codes and log. The real, pinned uv.exe (from PyPI)
downloads the Python archive from the test's server on 127.0.0.1 (UV_PYTHON_INSTALL_MIRROR,
UV_PYTHON_DOWNLOADS_JSON_URL), checks its hash and unpacks it (uv_helpers says how it starts
under wine 8).

What stands in (no real part can run here): uv.exe itself is a stand-in (uv_standin.c) that
hands `python install` to the real uv and does the virtualenv and wheel steps itself, fetching
from the test's package index (UV_DEFAULT_INDEX) on 127.0.0.1, because no Windows CPython can be
fetched here to run them; the Python archive's python.exe is the same stand-in. Wine has no
PowerShell, so install.ps1 (the upgrade's stop, the uninstall) is a batch file that plays its
part of the contract (wine_helpers.powershell_double). The progress page and the Retry button
are never shown (silent mode answers Cancel; the log shows the offer).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from install_helpers import REPO_ROOT
from uv_helpers import PYTHON_KEY, build_uv_standin, http_server, real_uv, serve_folder
from wine_helpers import POWERSHELL_DOUBLE, Wine, find_iscc, powershell_double

from strata import __version__

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP_ID_KEY = "{5B0C7E0A-3E7C-4B8E-9A59-7A4C2F1D6E21}_is1"
SETUP_CANNOT_PROCEED = 7  # Inno Setup's exit code when PrepareToInstall returns a reason
PS1 = REPO_ROOT / "installer" / "windows" / "install.ps1"
STEPS = ("Step 1 of 4: downloading Python 3.12 (private to Strata, about 30 MB)",
         "Step 2 of 4: creating Strata's environment",
         "Step 3 of 4: downloading PyTorch 2.13.0, CPU build (about 200 MB)",
         "Step 4 of 4: installing Strata and its libraries",
         "Checking the installation")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "strata-tests"


@pytest.fixture(scope="module")
def wine(tmp_path_factory) -> Iterator[Wine]:
    wine = Wine(tmp_path_factory.mktemp("wine") / "prefix")
    wine.boot()
    yield wine
    wine.stop()
    shutil.rmtree(wine.prefix, ignore_errors=True)  # 1.3 GB: Debian's wine copies its DLLs


@pytest.fixture(scope="module")
def uv_standin(tmp_path_factory) -> Path:
    return build_uv_standin(tmp_path_factory.mktemp("uv-standin"))


@pytest.fixture(scope="module")
def uv_settings(wine, uv_standin, tmp_path_factory) -> Iterator[dict[str, str]]:
    """The environment the setup runs in: uv's settings pointing at the test's server, and
    where the stand-in finds the real uv."""
    real = real_uv(CACHE / "uv", wine.c_drive / "strata-test" / "real-uv")
    root = tmp_path_factory.mktemp("served")
    serve_folder(root, uv_standin)
    with http_server(root) as url:
        yield {"UV_PYTHON_INSTALL_MIRROR": f"{url}/pbs",
               "UV_PYTHON_DOWNLOADS_JSON_URL": f"{url}/python-downloads.json",
               "UV_DEFAULT_INDEX": f"{url}/simple",
               "STRATA_TEST_REAL_UV": wine.windows_path(real)}


def _compile(wine: Wine, source_copy: Path, wheel: Path, uv: Path, name: str) -> Path:
    """strata-setup.exe, compiled by ISCC in the copy of the checkout (where the .iss expects
    dist/ and the wheel, as on Windows), with uv.exe and PowerShell replaced."""
    iscc = find_iscc(CACHE / "innosetup-compiler")
    dist = source_copy / "dist"
    dist.mkdir(exist_ok=True)
    shutil.copy2(wheel, dist / f"strata-{__version__}-py3-none-any.whl")
    shutil.copy2(uv, dist / "uv.exe")  # where fetch_uv.py puts the real one
    done = wine.run([str(iscc), "/Q", f"/DPowerShell={POWERSHELL_DOUBLE}",
                     f"/F{name}", r"installer\windows\strata.iss"], cwd=source_copy, timeout=300)
    assert done.returncode == 0, f"ISCC failed:\n{done.stdout}{done.stderr}"
    return dist / f"{name}.exe"


@pytest.fixture(scope="module")
def setup_exe(wine, source_copy, wheel, uv_standin) -> Path:
    return _compile(wine, source_copy, wheel, uv_standin, "strata-setup")


class Setup:
    """Runs the setup (or the uninstaller) silently into C:\\<name> and reads what it left."""

    def __init__(self, wine: Wine, setup_exe: Path, name: str, settings: dict[str, str]) -> None:
        self.wine, self.setup_exe, self.settings = wine, setup_exe, settings
        self.app_windows = f"C:\\{name}"
        self.app = wine.unix_path(self.app_windows)
        self.test_dir = wine.c_drive / "strata-test"
        self.test_dir.mkdir(exist_ok=True)
        self.log_path = self.test_dir / f"{name}.log"

    def use_powershell(self, exit_code: int, reason: str | None = None) -> None:
        (self.test_dir / "calls.txt").unlink(missing_ok=True)
        (self.test_dir / "powershell.cmd").write_text(powershell_double(exit_code, reason),
                                                      newline="")

    def install(self, *extra: str, **settings: str) -> int:
        self.log_path.unlink(missing_ok=True)
        (self.test_dir / "uv-calls.txt").unlink(missing_ok=True)
        done = self.wine.run([str(self.setup_exe), "/VERYSILENT", "/SUPPRESSMSGBOXES",
                              "/NORESTART", f"/DIR={self.app_windows}",
                              f"/LOG={self.wine.windows_path(self.log_path)}", *extra],
                             env={**self.settings, **settings})
        return done.returncode

    def uninstall(self) -> int:
        done = self.wine.run([self.wine.windows_path(self.app / "unins000.exe"), "/VERYSILENT",
                              "/SUPPRESSMSGBOXES", "/NORESTART"])
        return done.returncode

    @property
    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8-sig", errors="replace")

    def steps(self) -> list[str]:
        return [line.split('Step "', 1)[1].split('": ', 1)[0]
                for line in self.log.splitlines() if ' Step "' in line]

    @property
    def calls(self) -> list[str]:
        path = self.test_dir / "calls.txt"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    @property
    def uv_calls(self) -> list[str]:
        path = self.test_dir / "uv-calls.txt"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    @property
    def files(self) -> set[str]:
        return {p.name for p in self.app.iterdir()} if self.app.exists() else set()

    def shortcuts(self) -> list[Path]:
        return list(self.wine.c_drive.glob(
            "users/*/AppData/Roaming/Microsoft/Windows/Start Menu/Programs/Strata.lnk"))

    def user_registry(self) -> str:
        return (self.wine.prefix / "user.reg").read_text(errors="replace")


def test_setup_installs_a_private_python_and_strata_with_uv_and_uninstalls(
        wine, setup_exe, wheel, uv_settings, uv_standin):
    setup = Setup(wine, setup_exe, "StrataOK", uv_settings)
    setup.use_powershell(0)
    assert setup.install("/NEEDMIB=1") == 0, setup.log
    log = setup.log
    assert "Installation process succeeded." in log
    assert "Disk space on C:\\: " in log and " MiB free, 1 MiB needed" in log
    assert setup.steps() == list(STEPS), log
    # What uv printed reached the log (and the progress page): the real uv's own lines too.
    assert "uv: Installed Python 3.12.12 in " in log and f"uv:  + {PYTHON_KEY}" in log
    assert "uv: Downloaded torch (" in log
    assert setup.calls == []  # a fresh install: no running Strata to stop

    app = setup.app_windows
    calls = setup.uv_calls
    commands = [line for line in calls if line.startswith("uv ")]
    assert commands[0] == "uv python install 3.12 --no-bin --no-registry --no-config"
    assert commands[1] == f"uv venv --managed-python --python 3.12 --allow-existing --no-config {app}\\venv"
    assert commands[2].startswith(f"uv pip install --python {app}\\venv\\Scripts\\python.exe "
                                  "--constraints ")
    assert commands[2].endswith("constraints.txt --no-config torch==2.13.0")
    assert commands[3].endswith(f" --no-config --reinstall-package strata "
                                f"{commands[3].split()[-1]}")
    assert commands[3].split()[-1].endswith(f"strata-{__version__}-py3-none-any.whl")
    assert f"  UV_PYTHON_INSTALL_DIR={app}\\python" in calls
    assert f"  UV_CACHE_DIR={app}\\uv-cache" in calls
    assert "  real uv exited 0" in calls

    # The real uv unpacked the served archive into the private folder and marked it; it put
    # no python.exe on the user's PATH (--no-bin) and wrote no registry entry (--no-registry).
    python_home = setup.app / "python" / PYTHON_KEY
    assert (python_home / "python.exe").read_bytes() == uv_standin.read_bytes()
    assert (python_home / "Lib" / "EXTERNALLY-MANAGED").is_file()
    assert not list(wine.c_drive.glob("users/*/.local/bin/python*"))
    assert "Astral" not in setup.user_registry()

    assert setup.files == {"install.ps1", wheel.name, "unins000.exe", "unins000.dat",
                           "python", "venv", "uv-cache"}
    assert (setup.app / "install.ps1").read_bytes() == PS1.read_bytes()
    (shortcut,) = setup.shortcuts()
    link = shortcut.read_bytes()  # the target as an ANSI path, the arguments in UTF-16
    assert f"{app}\\venv\\Scripts\\pythonw.exe".encode() in link
    assert "-m strata.app.main".encode("utf-16-le") in link
    assert APP_ID_KEY in setup.user_registry()
    assert '"Strata"=' not in setup.user_registry()  # no login entry without the task

    # An upgrade stops the running Strata first (install.ps1 -StopOnly), then reuses the
    # environment; the autostart task writes the value the tray's switch writes.
    setup.use_powershell(0)
    assert setup.install("/NEEDMIB=1", "/TASKS=autostart") == 0, setup.log
    (call, *checks) = setup.calls
    assert f'-StopOnly -Prefix "{app}" -ErrorFile ' in call and checks == ["script exists"]
    escaped = f"{app}\\venv\\Scripts\\pythonw.exe".replace("\\", "\\\\")  # as user.reg writes it
    assert f'"Strata"="\\"{escaped}\\" -m strata.app.main"' in setup.user_registry()

    setup.use_powershell(0)
    assert setup.uninstall() == 0
    (call, *checks) = setup.calls
    assert checks == ["script exists"]  # the installed {app}\install.ps1
    assert f'-Uninstall -NoShortcut -Prefix "{app}" -ErrorFile ' in call, call
    assert setup.files == set()  # the private Python, the venv and uv's cache too
    assert setup.shortcuts() == []
    assert APP_ID_KEY not in setup.user_registry()
    assert '"Strata"=' not in setup.user_registry()


def test_real_uv_takes_the_setups_commands_and_finds_the_private_python(
        wine, setup_exe, uv_settings):
    """The stand-in reads its arguments loosely, so the real uv.exe gets the setup's venv and
    pip commands too, as the stand-in recorded them, in the same environment: it must get past
    its argument parsing and find the private Python, and stop only where it runs that Python
    (the test's archive has none that runs)."""
    setup = Setup(wine, setup_exe, "StrataRealUv", uv_settings)
    assert setup.install("/NEEDMIB=1") == 0, setup.log
    try:  # uninstalled whatever fails: a shortcut left behind fails the next tests
        calls = setup.uv_calls
        settings = dict(line.strip().split("=", 1) for line in calls if line.startswith("  UV_"))
        # The setup's temporary constraints file and wheel are gone: the same files, kept.
        constraints = setup.test_dir / "constraints.txt"
        shutil.copy2(REPO_ROOT / "installer" / "constraints.txt", constraints)
        kept = {"constraints.txt": setup.wine.windows_path(constraints),
                f"strata-{__version__}-py3-none-any.whl":
                    f"{setup.app_windows}\\strata-{__version__}-py3-none-any.whl"}
        real = wine.unix_path(uv_settings["STRATA_TEST_REAL_UV"])
        app = setup.app_windows
        queried = {"venv": f"{app}\\python\\{PYTHON_KEY}\\python.exe",
                   "pip": f"{app}\\venv\\Scripts\\python.exe"}
        commands = [line.split()[1:] for line in calls if line.startswith("uv ")]
        assert [c[0] for c in commands] == ["python", "venv", "pip", "pip"]
        for args in commands[1:]:
            args = [next((path for name, path in kept.items() if arg.endswith(name)), arg)
                    for arg in args]
            done = wine.run([str(real), *args], env={**uv_settings, **settings})
            output = done.stdout + done.stderr
            assert done.returncode == 2, output
            assert "unexpected argument" not in output, output
            # uv wraps its message at the terminal's width (run 2 of the suite: at "at"): compare
            # with the line breaks taken out.
            flat = " ".join(output.split())
            # uv reached the private Python and queried it: it says the answer was invalid,
            # or, when wine fails the query itself under load (os error 1359, seen once in a
            # full suite run), that the query failed; either names the path it was given.
            assert f"`{queried[args[0]]}`" in flat, output
            assert ("returned an invalid response" in flat
                    or "Failed to query Python interpreter" in flat), output
    finally:
        setup.use_powershell(0)
        uninstalled = setup.uninstall()
    assert uninstalled == 0


def _assert_nothing_installed(setup: Setup) -> None:
    assert not {"install.ps1", "unins000.exe"} & setup.files
    assert setup.shortcuts() == []
    assert "Creating the icon." not in setup.log
    assert "Creating new uninstall key" not in setup.log
    assert "Installation process succeeded." not in setup.log


def _assert_failure_page(setup: Setup, reason: str) -> None:
    """The reason (a regular expression) and the log's path, offered with Retry (silent:
    Cancel), then shown on the "Preparing to Install" page."""
    log = setup.log.replace("\r", "")
    log_path = re.escape(setup.wine.windows_path(setup.log_path))
    offer = "Defaulting to Cancel for suppressed message box \\(Retry/Cancel\\):\n *"
    assert re.search(f"{offer}{reason}\\.\n *\n *Details: {log_path}\n", log), log
    assert re.search(f"PrepareToInstall failed: {reason}\\. Details are in the setup log: "
                     f"{log_path}\n", log), log


def test_too_little_disk_space_stops_before_downloading(wine, setup_exe, uv_settings):
    setup = Setup(wine, setup_exe, "StrataNoSpace", uv_settings)
    assert setup.install("/NEEDMIB=100000100") == SETUP_CANNOT_PROCEED, setup.log
    _assert_failure_page(setup, re.escape("Not enough disk space on C:\\: Strata needs 97656.3 GiB "
                                          "(Python and PyTorch's CPU build), ") +
                         r"\d+\.\d GiB is free\. Free some space and retry")
    assert setup.uv_calls == [] and setup.steps() == []  # nothing was downloaded
    _assert_nothing_installed(setup)


def test_failing_uv_step_stops_the_setup_with_its_reason(wine, setup_exe, uv_settings):
    setup = Setup(wine, setup_exe, "StrataFails", uv_settings)
    missing = uv_settings["UV_DEFAULT_INDEX"].replace("/simple", "/missing")
    assert setup.install("/NEEDMIB=1", UV_DEFAULT_INDEX=missing) == SETUP_CANNOT_PROCEED
    _assert_failure_page(setup, re.escape(f"{STEPS[2]} failed (exit code 2): error: Failed to "
                                          f"fetch: {missing}/torch/"))
    assert setup.steps() == list(STEPS[:3])  # stopped at the failing step
    _assert_nothing_installed(setup)


def test_failing_stop_of_a_running_strata_stops_the_upgrade(wine, setup_exe, uv_settings):
    setup = Setup(wine, setup_exe, "StrataBusy", uv_settings)
    setup.use_powershell(0)
    assert setup.install("/NEEDMIB=1") == 0, setup.log
    reason = "could not stop process 1234"
    setup.use_powershell(1, reason)
    assert setup.install("/NEEDMIB=1") == SETUP_CANNOT_PROCEED, setup.log
    _assert_failure_page(setup, re.escape(f"Stopping the running Strata failed: {reason}"))
    assert setup.steps() == []
    setup.use_powershell(0)
    assert setup.uninstall() == 0
