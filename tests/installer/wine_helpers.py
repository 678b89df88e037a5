"""Wine and Inno Setup's compiler for the installer test: finding them, a headless prefix, and
a test double for powershell.exe (wine has no PowerShell: its powershell.exe is a stub that
prints "stub" and exits 0, which would make every install look successful).

Missing wine or ISCC fails the test (CI installs both, see .ci/run); STRATA_NO_WINE=1 says this
machine is not CI and has no wine, and turns the failure into a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

# 6.3 is the first Inno Setup that knows strata.iss's "x64compatible" architecture.
ISCC_NPM_PACKAGE = "innosetup-compiler@6.3.1"
# Where strata.iss is told (ISCC /DPowerShell=...) to find PowerShell: the double below.
POWERSHELL_DOUBLE = r"C:\strata-test\powershell.cmd"


def unavailable(reason: str) -> None:
    """Fail with the reason, or skip where STRATA_NO_WINE=1 says this is not CI."""
    if os.environ.get("STRATA_NO_WINE") == "1":
        pytest.skip(f"{reason} (STRATA_NO_WINE=1)")
    pytest.fail(f"{reason}; .ci/run installs it. On a machine that is not CI, "
                "STRATA_NO_WINE=1 skips this test instead", pytrace=False)


def find_iscc(cache: Path) -> Path:
    """ISCC.exe from $STRATA_ISCC, else from the npm package (installed into cache once)."""
    if given := os.environ.get("STRATA_ISCC"):
        if not Path(given).is_file():
            unavailable(f"STRATA_ISCC={given} is not a file")
        return Path(given)
    iscc = cache / "node_modules" / "innosetup-compiler" / "bin" / "ISCC.exe"
    if not iscc.is_file():
        npm = shutil.which("npm")
        if npm is None:
            unavailable(f"npm is missing, so {ISCC_NPM_PACKAGE} (Inno Setup's ISCC) cannot be "
                        "installed")
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(cache),
                               ISCC_NPM_PACKAGE], capture_output=True, text=True, timeout=300)
        if done.returncode != 0 or not iscc.is_file():
            unavailable(f"npm install {ISCC_NPM_PACKAGE} failed: {done.stderr.strip()[-500:]}")
    return iscc


class Wine:
    """One wine prefix without a display: wine's null graphics driver instead of X11, so the
    setup's hidden windows need no Xvfb."""

    def __init__(self, prefix: Path) -> None:
        wine = shutil.which("wine")
        if wine is None:
            unavailable("wine is missing (Debian: wine, wine32:i386, wine64)")
        self.wine = wine
        self.prefix = prefix
        self.env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
        self.env.update(WINEPREFIX=str(prefix), WINEDEBUG="-all",
                        # no offer to install Mono or Gecko, which nothing here uses
                        WINEDLLOVERRIDES="mscoree,mshtml=")

    @property
    def c_drive(self) -> Path:
        return self.prefix / "drive_c"

    def boot(self) -> None:
        self.run(["wineboot", "--init"], timeout=300, check=True)
        self.run(["reg", "add", r"HKCU\Software\Wine\Drivers", "/v", "Graphics", "/d", "null",
                  "/f"], check=True)
        # The desktop process started by wineboot keeps the driver it began with: end it.
        self.stop()

    def run(self, args: list[str], cwd: Path | None = None, timeout: float = 120,
            check: bool = False, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
        """wine ARGS (with env added to the prefix's environment), then wait until every
        process of the prefix has ended (the uninstaller hands over to a copy of itself and
        returns at once)."""
        done = subprocess.run([self.wine, *args], cwd=cwd, env={**self.env, **(env or {})},
                              capture_output=True,
                              text=True, errors="replace", timeout=timeout)
        subprocess.run(["wineserver", "-w"], env=self.env, timeout=timeout, check=True)
        if check and done.returncode != 0:
            raise AssertionError(f"wine {args} exited {done.returncode}:\n{done.stdout}"
                                 f"{done.stderr}")
        return done

    def stop(self) -> None:
        subprocess.run(["wineserver", "-k"], env=self.env, timeout=60, check=False)
        subprocess.run(["wineserver", "-w"], env=self.env, timeout=60, check=False)

    def windows_path(self, path: Path) -> str:
        """A path under drive_c as setup.exe sees it."""
        return "C:\\" + str(path.relative_to(self.c_drive)).replace("/", "\\")

    def unix_path(self, windows: str) -> Path:
        assert windows[:3].upper() == "C:\\", windows
        return self.c_drive.joinpath(*windows[3:].split("\\"))


def powershell_double(exit_code: int, reason: str | None) -> str:
    """A batch file standing in for powershell.exe: it logs its command line and whether the
    script (-File) and the wheel (-Source) it was given exist, writes `reason` to -ErrorFile
    (as install.ps1's Fail does) and exits with exit_code."""
    lines = [
        "@echo off",
        'set "ERRORFILE="',
        r">>C:\strata-test\calls.txt echo call: %*",
        ":next",
        'if "%~1"=="" goto done',
        r'if /i "%~1"=="-File" if exist "%~2" >>C:\strata-test\calls.txt echo script exists',
        r'if /i "%~1"=="-Source" if exist "%~2" >>C:\strata-test\calls.txt echo wheel exists',
        'if /i "%~1"=="-ErrorFile" set "ERRORFILE=%~2"',
        "shift",
        "goto next",
        ":done",
    ]
    if reason is not None:
        lines.append(f'if defined ERRORFILE >"%ERRORFILE%" echo {reason}')
    lines.append(f"exit /b {exit_code}")
    return "\r\n".join(lines) + "\r\n"
