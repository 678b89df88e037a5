"""Layer rules of DESIGN §1, checked on the source: a forbidden import fails the build."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "strata"

# package (relative to strata/) -> top-level modules it must never import
FORBIDDEN = {
    "engine/core": {"aiohttp", "PySide6"},
    "engine/service": {"PySide6"},
    "engine/api": {"PySide6"},
    "engine/text": {"PySide6", "torch", "aiohttp"},
    "engine/protocol.py": {"PySide6", "torch", "aiohttp"},
    "engine/gguf_file.py": {"PySide6", "torch", "aiohttp"},
    "engine/gguf_reader.py": {"PySide6", "torch", "aiohttp"},
    "library": {"PySide6", "torch", "aiohttp"},
    "host": {"PySide6", "torch"},
}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module a file imports, at any depth of the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def files_of(part: str) -> list[Path]:
    target = ROOT / part
    return [target] if target.is_file() else sorted(target.rglob("*.py"))


@pytest.mark.parametrize("part", sorted(FORBIDDEN))
def test_layer_imports(part: str) -> None:
    offenders = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in files_of(part)
        for name in sorted(imported_modules(path) & FORBIDDEN[part])
    ]
    assert not offenders, "; ".join(offenders)


def test_only_app_imports_qt() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        if "app" not in path.relative_to(ROOT).parts[:1] and "PySide6" in imported_modules(path)
    ]
    assert not offenders, f"Qt imported outside strata/app: {offenders}"


def test_the_service_leaves_the_api_to_the_composition_root() -> None:
    """engine/service never imports engine/api: the root (strata/host) hands it the service."""
    offenders = []
    for path in files_of("engine/service"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                          if n.startswith("strata.engine.api")]
    assert not offenders, "; ".join(offenders)


def test_checker_catches_a_forbidden_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from PySide6 import QtCore\n")
    assert "PySide6" in imported_modules(bad)
