"""Fixtures for installer and wheel tests: a copy of the checkout, a dependency overlay, the
default model, and an environment whose XDG folders all point into a temporary directory.

Speed: nothing heavy is installed. `python -m venv --system-site-packages` started from the
project venv would expose the *base* interpreter's packages, not the venv's torch, so instead
PYTHONPATH points at an overlay of links to the project venv's site-packages minus Strata and
pip. pip then sees torch and friends as installed and only installs Strata itself.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from install_helpers import REPO_ROOT

# Left out of the overlay: Strata must come from the install under test, pip from its venv.
_OVERLAY_SKIP_PREFIXES = ("strata", "__editable__", "pip", "_distutils_hack", "__pycache__")
_COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                      "__pycache__", ".pytest_cache", "test-artifacts")


@pytest.fixture(scope="session")
def source_copy(tmp_path_factory) -> Path:
    """The checkout's files (tracked and new, not ignored) copied away, so that building a
    wheel never writes build/ or *.egg-info into the shared working tree."""
    target = tmp_path_factory.mktemp("source") / "strata"
    try:
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"],
                                cwd=REPO_ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO_ROOT, target, ignore=_COPY_IGNORE)
        return target
    for name in filter(None, listed.decode().split("\0")):
        source = REPO_ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.fixture(scope="session")
def deps_overlay(tmp_path_factory) -> Path:
    """A folder of links to the project venv's packages, without Strata and pip."""
    overlay = tmp_path_factory.mktemp("deps-overlay")
    site_packages = Path(sysconfig.get_paths()["purelib"])
    for entry in site_packages.iterdir():
        if entry.name.startswith(_OVERLAY_SKIP_PREFIXES) or entry.suffix == ".pth":
            continue
        (overlay / entry.name).symlink_to(entry)
    return overlay


@pytest.fixture(scope="session")
def default_model_file() -> Path:
    """The cached default model (fetched once here if this machine never pulled it)."""
    from strata.default_model import default_model_path

    return default_model_path(fetch=True, progress=False)


@pytest.fixture(scope="session")
def wheel(source_copy, tmp_path_factory) -> Path:
    """Strata's wheel, built from the copy of the checkout (the wheel and Inno Setup tests)."""
    out = tmp_path_factory.mktemp("wheel")
    # --no-build-isolation: the project venv already has setuptools, so this works offline.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-q", "-w", str(out), str(source_copy)],
                   check=True)
    (built,) = out.glob("strata-*.whl")
    return built
