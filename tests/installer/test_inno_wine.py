"""strata.iss compiled with Inno Setup's ISCC and the setup run silently, both under wine.

What this runs for real: ISCC on the script, the setup's [Code] (PrepareToInstall and the
uninstall step), its file, shortcut and uninstall-key handling, its silent exit codes and log.
What it does not run: install.ps1. Wine has no PowerShell, so the setup is compiled with
/DPowerShell= pointing at a batch file that plays powershell.exe's part of the contract
(wine_helpers.powershell_double): it exits 0, or writes a reason to -ErrorFile and exits 1, as
install.ps1 does. Whether install.ps1 itself works on Windows is not tested here.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from install_helpers import REPO_ROOT
from wine_helpers import POWERSHELL_DOUBLE, Wine, find_iscc, powershell_double

from strata import __version__

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP_ID_KEY = "{5B0C7E0A-3E7C-4B8E-9A59-7A4C2F1D6E21}_is1"
SETUP_CANNOT_PROCEED = 7  # Inno Setup's exit code when PrepareToInstall returns a reason
PS1 = REPO_ROOT / "installer" / "windows" / "install.ps1"


@pytest.fixture(scope="module")
def wine(tmp_path_factory) -> Iterator[Wine]:
    wine = Wine(tmp_path_factory.mktemp("wine") / "prefix")
    wine.boot()
    yield wine
    wine.stop()
    shutil.rmtree(wine.prefix, ignore_errors=True)  # 1.3 GB: Debian's wine copies its DLLs


def _compile(wine: Wine, source_copy: Path, wheel: Path, powershell: str, name: str) -> Path:
    """strata-setup.exe, compiled by ISCC in the copy of the checkout (where the .iss expects
    dist/ and the wheel, as on Windows), with PowerShell's path replaced."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    iscc = find_iscc(cache / "strata-tests" / "innosetup-compiler")
    dist = source_copy / "dist"
    dist.mkdir(exist_ok=True)
    shutil.copy2(wheel, dist / f"strata-{__version__}-py3-none-any.whl")
    done = wine.run([str(iscc), "/Q", f"/DPowerShell={powershell}", f"/F{name}",
                     r"installer\windows\strata.iss"], cwd=source_copy, timeout=300)
    assert done.returncode == 0, f"ISCC failed:\n{done.stdout}{done.stderr}"
    return dist / f"{name}.exe"


@pytest.fixture(scope="module")
def setup_exe(wine, source_copy, wheel) -> Path:
    return _compile(wine, source_copy, wheel, POWERSHELL_DOUBLE, "strata-setup")


class Setup:
    """Runs the setup (or the uninstaller) silently into C:\\<name> and reads what it left."""

    def __init__(self, wine: Wine, setup_exe: Path, name: str) -> None:
        self.wine, self.setup_exe = wine, setup_exe
        self.app_windows = f"C:\\{name}"
        self.app = wine.unix_path(self.app_windows)
        self.test_dir = wine.c_drive / "strata-test"
        self.test_dir.mkdir(exist_ok=True)
        self.log_path = self.test_dir / f"{name}.log"

    def use_powershell(self, exit_code: int, reason: str | None = None) -> None:
        (self.test_dir / "calls.txt").unlink(missing_ok=True)
        (self.test_dir / "powershell.cmd").write_text(powershell_double(exit_code, reason),
                                                      newline="")

    def install(self, *extra: str) -> int:
        self.log_path.unlink(missing_ok=True)
        done = self.wine.run([str(self.setup_exe), "/VERYSILENT", "/SUPPRESSMSGBOXES",
                              "/NORESTART", f"/DIR={self.app_windows}",
                              f"/LOG={self.wine.windows_path(self.log_path)}", *extra])
        return done.returncode

    def uninstall(self) -> int:
        done = self.wine.run([self.wine.windows_path(self.app / "unins000.exe"), "/VERYSILENT",
                              "/SUPPRESSMSGBOXES", "/NORESTART"])
        return done.returncode

    @property
    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8-sig", errors="replace")

    @property
    def calls(self) -> list[str]:
        path = self.test_dir / "calls.txt"
        return path.read_text(errors="replace").splitlines() if path.exists() else []

    @property
    def files(self) -> set[str]:
        return {p.name for p in self.app.iterdir()} if self.app.exists() else set()

    def shortcuts(self) -> list[Path]:
        return list(self.wine.c_drive.glob(
            "users/*/AppData/Roaming/Microsoft/Windows/Start Menu/Programs/Strata.lnk"))

    def uninstall_key(self) -> bool:
        return APP_ID_KEY in (self.wine.prefix / "user.reg").read_text(errors="replace")


def test_setup_installs_after_install_ps1_succeeds_and_uninstalls(wine, setup_exe, wheel):
    setup = Setup(wine, setup_exe, "StrataOK")
    setup.use_powershell(0)
    assert setup.install() == 0, setup.log
    assert "Installation process succeeded." in setup.log

    # install.ps1 ran once, before any file was installed, with both files it needs.
    (call, *checks) = setup.calls
    assert call.startswith("call: -NoProfile -ExecutionPolicy Bypass -File "), call
    assert "install.ps1" in call and f'-Prefix "{setup.app_windows}"' in call
    assert f'strata-{__version__}-py3-none-any.whl" -NoShortcut -ErrorFile ' in call
    assert "-Autostart" not in call and "-CpuOnly" not in call
    assert checks == ["script exists", "wheel exists"]

    assert setup.files == {"install.ps1", wheel.name, "unins000.exe", "unins000.dat"}
    assert (setup.app / "install.ps1").read_bytes() == PS1.read_bytes()
    assert (setup.app / wheel.name).read_bytes() == wheel.read_bytes()
    (shortcut,) = setup.shortcuts()
    link = shortcut.read_bytes()  # the target as an ANSI path, the arguments in UTF-16
    assert f"{setup.app_windows}\\venv\\Scripts\\pythonw.exe".encode() in link
    assert "-m strata.app.main".encode("utf-16-le") in link
    assert setup.uninstall_key()

    setup.use_powershell(0)
    assert setup.uninstall() == 0
    (call, *checks) = setup.calls
    assert checks == ["script exists"]  # the installed {app}\install.ps1
    assert f'-Uninstall -NoShortcut -Prefix "{setup.app_windows}" -ErrorFile ' in call, call
    assert setup.files == set()
    assert setup.shortcuts() == []
    assert not setup.uninstall_key()


def _assert_nothing_installed(setup: Setup) -> None:
    assert setup.files == set()
    assert "Creating the icon." not in setup.log
    assert "Creating new uninstall key" not in setup.log
    assert "Installation process succeeded." not in setup.log


def test_failing_install_ps1_stops_the_setup_with_its_reason(wine, setup_exe):
    setup = Setup(wine, setup_exe, "StrataFails")
    reason = "no 64-bit Python 3.11 or newer found by py -0p"
    setup.use_powershell(1, reason)
    assert setup.install("/TASKS=autostart,cpuonly") == SETUP_CANNOT_PROCEED, setup.log
    assert f"Installing Strata and PyTorch failed: {reason}" in setup.log
    (call, *_) = setup.calls
    assert "-NoShortcut -Autostart -CpuOnly -ErrorFile " in call, call  # the tasks' switches
    _assert_nothing_installed(setup)


def test_bare_exit_code_is_reported_without_a_reason(wine, setup_exe):
    setup = Setup(wine, setup_exe, "StrataExitCode")
    setup.use_powershell(5)
    assert setup.install() == SETUP_CANNOT_PROCEED, setup.log
    assert "Installing Strata and PyTorch failed with exit code 5" in setup.log
    _assert_nothing_installed(setup)


def test_missing_powershell_stops_the_setup(wine, source_copy, wheel):
    # The double is started through cmd.exe, which itself starts even without the .cmd file:
    # this setup is compiled to start a powershell.exe that does not exist.
    setup_exe = _compile(wine, source_copy, wheel, r"C:\nowhere\powershell.exe",
                         "strata-setup-no-powershell")
    setup = Setup(wine, setup_exe, "StrataNoPowerShell")
    assert setup.install() == SETUP_CANNOT_PROCEED, setup.log
    assert "Installing Strata and PyTorch failed: PowerShell could not be started" in setup.log
    _assert_nothing_installed(setup)
