"""The dependency set resolves for Windows (win_amd64) on every supported Python, by uv's
cross-platform resolver against PyPI (CI has network; this is a check of the published wheels,
so it cannot be done offline)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.timeout(300)
REPO_ROOT = Path(__file__).resolve().parents[2]


def _uv() -> list[str]:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert found, "uv is missing: it is a dev dependency (pip install -e '.[dev]')"
    return [found]


def _compile(python_version: str, *extra: str) -> dict[str, str]:
    result = subprocess.run(
        [*_uv(), "pip", "compile", "--python-platform", "windows", "--python-version",
         python_version, "--no-header", *extra, str(REPO_ROOT / "pyproject.toml")],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert result.returncode == 0, f"no Windows resolution for Python {python_version}:\n" + (
        result.stderr[-2000:])
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", result.stdout, re.MULTILINE)
    return {name.lower(): version for name, version in pins}


@pytest.mark.parametrize("python_version", ["3.11", "3.12", "3.13"])
def test_dependencies_resolve_for_windows(python_version):
    pins = _compile(python_version, "--extra", "dev")
    for name in ("torch", "cuda-python", "pyside6-essentials", "nvidia-ml-py", "platformdirs",
                 "mslex", "psutil", "aiohttp"):
        assert name in pins, f"{name} missing from the Windows resolution"
    assert "triton" not in pins  # Linux-only marker: no Windows wheels exist


def test_the_cuda_python_floor_has_cuda_bindings_and_installs_on_windows():
    """cuda-python 12.6.2.post1 is the first release shipping the cuda.bindings package that
    the engine imports (12.6.0 and older have only cuda.cuda; checked in the wheels)."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    line = re.search(r'"(cuda-python[^"]*)"', text).group(1)
    spec = Requirement(line).specifier
    assert not spec.contains("12.6.0") and spec.contains("12.6.2.post1")
    pins = _compile("3.11", "--resolution", "lowest-direct")
    assert pins["cuda-python"] == "12.6.2.post1"
