"""Helpers for the installer and wheel tests: paths, the base interpreter, an isolated env."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def base_python() -> str:
    """The interpreter the project venv was made from (a venv's own python cannot nest one)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def isolated_env(tmp_path: Path, deps_overlay: Path, **extra: str) -> dict[str, str]:
    """os.environ with HOME and every XDG folder inside tmp_path and the overlay on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("XDG_", "STRATA_", "VIRTUAL_ENV", "PYTHON"))}
    for name in ("HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_STATE_HOME"):
        env[name] = str(tmp_path / name.lower())
    env["PYTHONPATH"] = str(deps_overlay)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env
