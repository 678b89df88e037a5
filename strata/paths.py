"""Where Strata keeps models, snapshots, logs and its config file.

Linux (and macOS) keep the XDG layout (~/.local/share/strata, ~/.config/strata, ~/.cache/strata,
~/.local/state/strata). Windows asks platformdirs for the shell's known folders: data, cache and
logs under %LOCALAPPDATA%\\Strata, the config file under %APPDATA%\\Strata (it roams with the
user; models and caches are too big to). platformdirs rather than reading the environment
by hand: it asks the shell, which is right where a folder was redirected.

Every function only computes a path; callers create directories when they write there, so that
asking "where would it be" never touches the disk.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

APP_NAME_WINDOWS = "Strata"


def _is_windows() -> bool:
    return sys.platform == "win32"


def _windows_dir(kind: str) -> Path:
    from platformdirs.windows import Windows

    dirs = Windows(APP_NAME_WINDOWS, appauthor=False, roaming=kind == "config")
    return Path({"data": dirs.user_data_dir, "config": dirs.user_config_dir,
                 "cache": dirs.user_cache_dir, "log": dirs.user_log_dir}[kind])


def _xdg_dir(env_name: str, default_relative: str) -> Path:
    # XDG says a relative or empty value must be ignored.
    value = os.environ.get(env_name, "")
    if value and os.path.isabs(value):
        return Path(value)
    return Path.home() / default_relative


def strata_home() -> Path:
    """Strata's data directory: $STRATA_HOME, else $XDG_DATA_HOME/strata (~/.local/share/strata);
    on Windows %LOCALAPPDATA%\\Strata."""
    value = os.environ.get("STRATA_HOME", "")
    if value:
        return Path(value).expanduser()
    if _is_windows():
        return _windows_dir("data")
    return _xdg_dir("XDG_DATA_HOME", ".local/share") / "strata"


def model_cache_dir() -> Path:
    """Directory holding downloaded models (the embedded default among them)."""
    return strata_home() / "models"


def snapshot_dir() -> Path:
    """Directory for KV-cache snapshot files and explicitly saved slots."""
    return strata_home() / "snapshots"


def kernel_cache_dir() -> Path:
    """Compiled GPU kernels (torch.compile's): $XDG_CACHE_HOME/strata/kernels, which unlike
    torch's default under /tmp survives a reboot, so only a machine's first load compiles.
    On Windows %LOCALAPPDATA%\\Strata\\Cache\\kernels."""
    if _is_windows():
        return _windows_dir("cache") / "kernels"
    return _xdg_dir("XDG_CACHE_HOME", ".cache") / "strata" / "kernels"


def config_path() -> Path:
    """The config file: $STRATA_CONFIG, else $XDG_CONFIG_HOME/strata/config.toml; on Windows
    %APPDATA%\\Strata\\config.toml."""
    value = os.environ.get("STRATA_CONFIG", "")
    if value:
        return Path(value).expanduser()
    if _is_windows():
        return _windows_dir("config") / "config.toml"
    return _xdg_dir("XDG_CONFIG_HOME", ".config") / "strata" / "config.toml"


def log_dir() -> Path:
    """Rotating log files (the tray's always; the server's and engine's when they have no
    console): $XDG_STATE_HOME/strata/logs (~/.local/state/strata/logs); on Windows
    %LOCALAPPDATA%\\Strata\\Logs."""
    if _is_windows():
        return _windows_dir("log")
    return _xdg_dir("XDG_STATE_HOME", ".local/state") / "strata" / "logs"
