"""installer/constraints.txt names the torch and triton-windows versions Strata is pinned to;
every other file that names them (README, the installers, pyproject.toml, .ci/run, the getting
started page) must say the same, or this fails."""

from __future__ import annotations

import re

from install_helpers import REPO_ROOT
from packaging.requirements import Requirement

CONSTRAINTS = REPO_ROOT / "installer" / "constraints.txt"
# Files that install or document the pinned versions.
NAMING_FILES = ("README.md", ".ci/run", "docs/getting-started.md", "installer/linux/install.sh",
                "installer/windows/install.ps1", "installer/windows/strata.iss")


def pins() -> dict[str, str]:
    """name -> the exact version constraints.txt pins."""
    found = {}
    for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", line
            found[requirement.name] = spec.version
    return found


def test_constraints_pin_torch_and_triton_windows():
    assert set(pins()) == {"torch", "triton-windows"}


def test_every_file_names_the_pinned_versions():
    pinned = pins()
    mismatches = []
    for name in NAMING_FILES:
        text = (REPO_ROOT / name).read_text(encoding="utf-8")
        for package, version in re.findall(r"\b(torch|triton-windows)==([\w.+]+)", text):
            if version != pinned[package] and not version.startswith("$"):
                mismatches.append(f"{name}: {package}=={version}")
    assert not mismatches, f"not the pins of {CONSTRAINTS.name} {pinned}: {mismatches}"


def test_installers_default_to_the_pinned_torch():
    torch = pins()["torch"]
    ps1 = (REPO_ROOT / "installer/windows/install.ps1").read_text(encoding="utf-8")
    assert re.search(r'\[string\]\$TorchVersion = "([\w.]+)"', ps1)[1] == torch
    sh = (REPO_ROOT / "installer/linux/install.sh").read_text(encoding="utf-8")
    assert re.search(r'^TORCH_VERSION="([\w.]+)"', sh, re.MULTILINE)[1] == torch
    iss = (REPO_ROOT / "installer/windows/strata.iss").read_text(encoding="utf-8")
    assert re.search(r'^#define TorchVersion "([\w.]+)"', iss, re.MULTILINE)[1] == torch
    ci = (REPO_ROOT / ".ci/run").read_text(encoding="utf-8")
    assert f"torch=={torch}" in ci
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert f"torch=={torch}" in readme and f"triton-windows {pins()['triton-windows']}" in readme


def test_pyproject_ranges_hold_the_pins():
    text = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for package, version in pins().items():
        (line,) = re.findall(rf'"({package}[<>=][^"]*)"', text)
        assert Requirement(line).specifier.contains(version), (line, version)
