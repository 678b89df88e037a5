"""The import graph of strata, read from the source: no cycles, and the reference model never
reaches the fast path.

Every import counts, at any depth of a file: a lazy import inside a function or under
TYPE_CHECKING that closes a loop is still a loop (it only moves the failure to run time or
hides it from the reader). `from a.b import c` depends on the module a.b.c where there is one,
else on a.b; a module does not depend on the packages above what it imports (their
__init__ runs, but that is Python's order of execution, not a design dependency), as in
import-linter's graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "strata"

# Cycles outside this test's change that their owners are removing (issue 21). An entry that
# is no longer a cycle fails test_known_cycles_are_still_cycles, so this list only shrinks.
KNOWN_CYCLES = [
    # openai_chat.py imports openai_routes.end_stream/send_stream_error in a function.
    {"strata.engine.api.openai_chat", "strata.engine.api.openai_routes"},
]


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root (root's own name first)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports, anywhere in its file."""
    modules = module_files(root)

    def known(name: str) -> str | None:  # the longest prefix that is a module here
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules else known(base))
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for child in graph.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return seen


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def describe(component: set[str], graph: dict[str, set[str]]) -> str:
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & component))}"
                     for m in sorted(component))


def test_no_import_cycles(graph) -> None:
    new = [c for c in cycles(graph) if c not in KNOWN_CYCLES]
    assert not new, "import cycles: " + " | ".join(describe(c, graph) for c in new)


def test_known_cycles_are_still_cycles(graph) -> None:
    gone = [c for c in KNOWN_CYCLES if c not in cycles(graph)]
    assert not gone, f"no longer cycles, remove them from KNOWN_CYCLES: {gone}"


def test_reference_model_never_reaches_the_fast_path(graph) -> None:
    """models/ is the numerical reference the fast path is checked against: it must not run
    fast-path code, not even through quant/ (shared kernel plumbing lives in kernels/)."""
    offenders = {
        model: sorted(m for m in reachable(graph, model) if m.startswith("strata.engine.core.fast"))
        for model in graph if model.startswith("strata.engine.core.models")
    }
    offenders = {model: fast for model, fast in offenders.items() if fast}
    assert not offenders, f"the reference model imports the fast path: {offenders}"


def test_checker_finds_lazy_and_relative_cycles(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\n"
                                          "if TYPE_CHECKING:\n    from ..c import C\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg import a\n")  # into the cycle, not part of it
    graph = import_graph(package)
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert cycles(graph) == [{"pkg.a", "pkg.sub.b", "pkg.c"}]
