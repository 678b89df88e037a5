"""Where Strata keeps models, snapshots and its config file.

Every function only computes a path; callers create directories when they write there, so that
asking "where would it be" never touches the disk.
"""

from __future__ import annotations

import os
from pathlib import Path


def _xdg_dir(env_name: str, default_relative: str) -> Path:
    # XDG says a relative or empty value must be ignored.
    value = os.environ.get(env_name, "")
    if value and os.path.isabs(value):
        return Path(value)
    return Path.home() / default_relative


def strata_home() -> Path:
    """Strata's data directory: $STRATA_HOME, else $XDG_DATA_HOME/strata (~/.local/share/strata)."""
    value = os.environ.get("STRATA_HOME", "")
    if value:
        return Path(value).expanduser()
    return _xdg_dir("XDG_DATA_HOME", ".local/share") / "strata"


def model_cache_dir() -> Path:
    """Directory holding downloaded models (the embedded default among them)."""
    return strata_home() / "models"


def snapshot_dir() -> Path:
    """Directory for KV-cache snapshot files and explicitly saved slots."""
    return strata_home() / "snapshots"


def kernel_cache_dir() -> Path:
    """Compiled GPU kernels (torch.compile's): $XDG_CACHE_HOME/strata/kernels, which unlike
    torch's default under /tmp survives a reboot, so only a machine's first load compiles."""
    return _xdg_dir("XDG_CACHE_HOME", ".cache") / "strata" / "kernels"


def config_path() -> Path:
    """The config file: $STRATA_CONFIG, else $XDG_CONFIG_HOME/strata/config.toml."""
    value = os.environ.get("STRATA_CONFIG", "")
    if value:
        return Path(value).expanduser()
    return _xdg_dir("XDG_CONFIG_HOME", ".config") / "strata" / "config.toml"
