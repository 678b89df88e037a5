"""Start the tray at login: XDG autostart entry (Linux), HKCU Run key (Windows). Qt-free."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from strata.errors import StrataError

ENTRY_NAME = "strata-tray"
_RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"


class AutostartError(StrataError):
    """Autostart could not be changed; the message says where and what to do."""


def launch_command() -> list[str]:
    """The argv that starts the tray: the installed console script, else this interpreter."""
    script = shutil.which("strata-tray")
    return [script] if script else [sys.executable, "-m", "strata.app.main"]


def desktop_entry_path() -> Path:
    """~/.config/autostart/strata-tray.desktop (honours XDG_CONFIG_HOME)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "autostart" / f"{ENTRY_NAME}.desktop"


def _quote_exec_arg(arg: str) -> str:
    # Desktop Entry spec: quote args with reserved characters; inside quotes escape " ` $ \
    if arg and not any(c in arg for c in " \t\n\"'\\><~|&;$*?#()`"):
        return arg
    escaped = "".join("\\" + c if c in '"`$\\' else c for c in arg)
    return f'"{escaped}"'


def desktop_entry(command: list[str]) -> str:
    """The text of the autostart .desktop file for command."""
    exec_line = " ".join(_quote_exec_arg(a).replace("%", "%%") for a in command)
    return (
        "[Desktop Entry]\nType=Application\nName=Strata\n"
        "Comment=Local LLM server that shares the GPU\n"
        f"Exec={exec_line}\nIcon=strata\nTerminal=false\nX-GNOME-Autostart-enabled=true\n"
    )


def is_autostart_enabled() -> bool:
    """True when Strata starts at login for this user."""
    if sys.platform == "win32":
        import winreg

        try:
            with winreg.OpenKey(winreg.HKEY_CURRENT_USER, _RUN_KEY) as key:
                winreg.QueryValueEx(key, "Strata")
            return True
        except OSError:
            return False
    return desktop_entry_path().is_file()


def set_autostart(is_enabled: bool, command: list[str] | None = None) -> None:
    """Turn start-at-login on or off; raises AutostartError with a one-line reason on failure."""
    command = command or launch_command()
    if sys.platform == "win32":
        _set_windows(is_enabled, command)
        return
    if sys.platform == "darwin":
        raise AutostartError(
            "autostart is not supported on macOS yet; add strata-tray to "
            "System Settings > General > Login Items"
        )
    path = desktop_entry_path()
    try:
        if is_enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(desktop_entry(command), encoding="utf-8")
            tmp.replace(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:
        raise AutostartError(
            f"could not change autostart entry {path}: {exc.strerror}; "
            "check that the folder is writable"
        ) from exc


def _set_windows(is_enabled: bool, command: list[str]) -> None:
    if sys.platform != "win32":  # winreg exists only there (so mypy reads this on Windows only)
        raise AutostartError("the Run key in the registry exists only on Windows")
    import subprocess
    import winreg

    try:
        with winreg.CreateKey(winreg.HKEY_CURRENT_USER, _RUN_KEY) as key:
            if is_enabled:
                winreg.SetValueEx(key, "Strata", 0, winreg.REG_SZ, subprocess.list2cmdline(command))
            else:
                try:
                    winreg.DeleteValue(key, "Strata")
                except FileNotFoundError:
                    pass
    except OSError as exc:
        raise AutostartError(f"could not change the Run key HKCU\\{_RUN_KEY}: {exc}") from exc
