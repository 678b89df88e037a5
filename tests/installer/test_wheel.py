"""The wheel alone: built from the checkout, installed with --no-deps into a fresh venv, it
carries its icons and its console scripts run."""

from __future__ import annotations

import configparser
import subprocess
import sys
import zipfile

import pytest
from install_helpers import REPO_ROOT, base_python, isolated_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ICONS = sorted(p.name for p in (REPO_ROOT / "strata/resources/icons").glob("*.svg"))


def test_wheel_holds_the_package_and_its_icons_but_no_tests(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert ICONS and {f"strata/resources/icons/{icon}" for icon in ICONS} <= set(names)
    assert "strata/cli.py" in names and "strata/engine/api/openapi.py" in names
    assert not [n for n in names if n.startswith(("tests/", "bench/", "installer/"))]
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    sections = configparser.ConfigParser()
    sections.read_string(scripts)
    assert dict(sections["console_scripts"]) == {"strata": "strata.cli:main"}
    # A GUI script: pythonw on Windows, so the tray opens no console window at login.
    assert dict(sections["gui_scripts"]) == {"strata-tray": "strata.app.main:main"}


def test_wheel_installs_alone_and_runs(wheel, deps_overlay, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([base_python(), "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # The project's pip installs into the new venv: faster than bootstrapping one there.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "-q", "--disable-pip-version-check", str(wheel)], check=True)
    env = isolated_env(tmp_path, deps_overlay)
    version = subprocess.run([venv / "bin" / "strata", "--version"], env=env,
                             check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == "strata 0.1.0"
    assert (venv / "bin" / "strata-tray").is_file()
    probe = ("import strata, importlib.resources as r; print(strata.__file__); "
             "print(' '.join(sorted(p.name for p in (r.files('strata.resources') / 'icons')"
             ".iterdir() if p.name.endswith('.svg'))))")
    # cwd away from the checkout: `python -c` puts the cwd first on sys.path.
    found = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True,
                           check=True, cwd=tmp_path).stdout.splitlines()
    assert found[0].startswith(str(venv)), f"strata was imported from {found[0]}, not the wheel"
    assert found[1].split() == ICONS
