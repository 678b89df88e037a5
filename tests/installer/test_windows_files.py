"""Static checks of the Windows installer files. Nothing here runs on Windows (nothing could be
run there); these only keep the files consistent with the package and the docs."""

from __future__ import annotations

import re

from install_helpers import REPO_ROOT

from strata import __version__

WINDOWS = REPO_ROOT / "installer" / "windows"


def _ps1_parameters() -> set[str]:
    text = (WINDOWS / "install.ps1").read_text(encoding="utf-8")
    block = text[text.index("param("):text.index("\n)\n")]
    return set(re.findall(r"\$(\w+)", block)) - {"env"}


def test_inno_script_version_and_wheel_match_the_package():
    iss = (WINDOWS / "strata.iss").read_text(encoding="utf-8")
    assert f'#define AppVersion "{__version__}"' in iss
    assert '#define Wheel "strata-" + AppVersion + "-py3-none-any.whl"' in iss
    for source in re.findall(r'^Source: "([^"]+)"', iss, re.MULTILINE):
        # dist\ holds build outputs (the wheel, fetch_uv.py's uv.exe)
        if "{#" not in source and "LICENSE" not in source and "dist\\" not in source:
            path = WINDOWS.joinpath(*source.split("\\"))
            assert path.is_file(), f"strata.iss ships {source}, which is missing"


def test_inno_script_passes_only_parameters_install_ps1_has():
    iss = (WINDOWS / "strata.iss").read_text(encoding="utf-8")
    passed = set(re.findall(r" -([A-Z]\w+)", iss)) - {"NoProfile", "ExecutionPolicy", "File"}
    assert passed and passed <= _ps1_parameters(), passed - _ps1_parameters()


def test_documented_powershell_switches_exist():
    page = (REPO_ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"install\.ps1 -(\w+)", page)) | set(re.findall(r"`-(\w+)`", page))
    assert documented and documented <= _ps1_parameters(), documented - _ps1_parameters()


def test_autostart_uses_the_trays_own_run_value():
    # The tray's "Start at login" switch and the installer must name the same Run value.
    ps1 = (WINDOWS / "install.ps1").read_text(encoding="utf-8")
    assert "from strata.app.autostart import set_autostart" in ps1
    assert '-Name "Strata"' in ps1
    autostart = (REPO_ROOT / "strata" / "app" / "autostart.py").read_text(encoding="utf-8")
    assert '"Strata"' in autostart


def _iss_section(iss: str, name: str) -> str:
    match = re.search(rf"^\[{name}\]\n(.*?)(?=^\[\w+\]\n|\Z)", iss, re.MULTILINE | re.DOTALL)
    return match.group(1) if match else ""


def test_inno_script_checks_install_ps1s_exit_code_before_installing_anything():
    """[Run] ignored install.ps1's exit code and offered to start a virtualenv that did not
    exist; [Code] now runs it in PrepareToInstall and stops the setup with its reason."""
    iss = (WINDOWS / "strata.iss").read_text(encoding="utf-8")
    for section in ("Run", "UninstallRun"):
        assert "install.ps1" not in _iss_section(iss, section), section
    code = _iss_section(iss, "Code")
    assert "function PrepareToInstall(var NeedsRestart: Boolean): String;" in code
    assert "if ResultCode <> 0 then" in code and "LoadStringFromFile(ErrorFile, Message)" in code
    assert "Result := InstallRuntime;" in code  # a non-empty result stops the setup
    assert "MB_RETRYCANCEL" in code  # a failed step offers Retry
    assert "procedure CurUninstallStepChanged" in code and "-Uninstall" in code
