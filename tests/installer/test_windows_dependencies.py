"""The dependency set resolves for Windows (win_amd64) on every Python that requires-python
allows, with the pinned torch and triton-windows (installer/constraints.txt), by uv's
cross-platform resolver against PyPI (CI has network; this is a check of the published wheels,
so it cannot be done offline)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

pytestmark = pytest.mark.timeout(300)
REPO_ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = REPO_ROOT / "installer" / "constraints.txt"
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def supported_pythons() -> list[str]:
    """Every CPython 3.x minor that requires-python allows (it must have an upper bound)."""
    allowed = SpecifierSet(PYPROJECT["project"]["requires-python"])
    versions = [f"3.{minor}" for minor in range(0, 40) if allowed.contains(f"3.{minor}")]
    assert versions and versions[-1] != "3.39", f"requires-python has no upper bound: {allowed}"
    return versions


def _uv() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert found, "uv is missing: it is a dev dependency (pip install -e '.[dev]')"
    return found


def _compile(python_version: str, *extra: str,
             platform: str = "windows") -> subprocess.CompletedProcess[str]:
    # UV_PYTHON_DOWNLOADS=never: the resolution needs no interpreter of that version, and
    # uv would otherwise try (and, offline, fail) to download one first.
    return subprocess.run(
        [_uv(), "pip", "compile", "--python-platform", platform, "--python-version",
         python_version, "--no-header", "-c", str(CONSTRAINTS), *extra,
         str(REPO_ROOT / "pyproject.toml")],
        capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"},
    )


def _resolved(python_version: str, *extra: str, platform: str = "windows") -> dict[str, str]:
    done = _compile(python_version, *extra, platform=platform)
    assert done.returncode == 0, (f"no {platform} resolution for Python {python_version} with "
                                  f"the pins of {CONSTRAINTS.name}:\n" + done.stderr[-2000:])
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", done.stdout, re.MULTILINE)
    return {name.lower(): version for name, version in pins}


def _constraint(name: str) -> str:
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line and Requirement(line).name == name:
            (spec,) = Requirement(line).specifier
            return spec.version
    raise AssertionError(f"{CONSTRAINTS.name} names no {name}")


def test_supported_pythons_come_from_requires_python():
    assert supported_pythons() == ["3.11", "3.12", "3.13", "3.14"]


@pytest.mark.parametrize("python_version", supported_pythons())
def test_dependencies_resolve_for_windows(python_version):
    pins = _resolved(python_version, "--extra", "dev")
    for name in ("torch", "cuda-python", "pyside6-essentials", "nvidia-ml-py", "platformdirs",
                 "mslex", "psutil", "aiohttp", "triton-windows"):
        assert name in pins, f"{name} missing from the Windows resolution"
    assert pins["torch"] == _constraint("torch")
    assert pins["triton-windows"] == _constraint("triton-windows")
    assert "triton" not in pins  # Linux's package: no Windows wheels


def test_the_first_python_past_requires_python_has_no_pinned_torch():
    """requires-python ends where the pinned torch's wheels end: a torch release with no wheel
    for the next CPython is why the bound exists, and the setup must not pick that Python."""
    allowed = SpecifierSet(PYPROJECT["project"]["requires-python"])
    last = supported_pythons()[-1]
    following = f"3.{int(last.split('.')[1]) + 1}"
    assert not allowed.contains(following)
    done = subprocess.run(
        [_uv(), "pip", "compile", "--python-platform", "windows", "--python-version", following,
         "--no-header", "-"], input=f"torch=={_constraint('torch')}\n", capture_output=True,
        text=True, timeout=240, check=False, env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"})
    assert done.returncode != 0, f"torch {_constraint('torch')} resolves for {following}: " \
                                 "widen requires-python"
    assert "torch" in done.stderr


def test_linux_gets_triton_through_the_pinned_torch():
    """Linux needs no triton requirement of its own: PyPI's torch pulls the matching one."""
    pins = _resolved(supported_pythons()[0], platform="x86_64-manylinux_2_28")
    assert pins["torch"] == _constraint("torch")
    # triton-windows X.Y.Z.postN is Triton X.Y.Z for Windows: the same minor release.
    minor = ".".join(_constraint("triton-windows").split(".")[:2])
    assert pins["triton"].startswith(minor + "."), (pins["triton"], minor)
    assert "triton-windows" not in pins


def test_the_cuda_python_floor_has_cuda_bindings_and_installs_on_windows():
    """cuda-python 12.6.2.post1 is the first release shipping the cuda.bindings package that
    the engine imports (12.6.0 and older have only cuda.cuda; checked in the wheels)."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    line = re.search(r'"(cuda-python[^"]*)"', text).group(1)
    spec = Requirement(line).specifier
    assert not spec.contains("12.6.0") and spec.contains("12.6.2.post1")
    pins = _resolved(supported_pythons()[0], "--resolution", "lowest-direct")
    assert pins["cuda-python"] == "12.6.2.post1"
