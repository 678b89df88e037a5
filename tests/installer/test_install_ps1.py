"""installer/windows/install.ps1 without Windows: parsed with tree-sitter-powershell, and the
patterns that pick a Python out of `py -0p` applied to outputs in the launcher's format.

The recordings in py_0p/ follow CPython's PC/launcher2.c (`_printEnvironment`: " %-16s %s",
the tag "-V:3.12" with " *" on the default, "Company/Tag" for other distributions) and, for
launcher_old.txt, the pre-3.11 launcher (" -3.9-64  path *"). They were not captured on a
Windows machine (none was available).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from install_helpers import REPO_ROOT

tree_sitter = pytest.importorskip("tree_sitter", reason="tree-sitter is a dev dependency")
tree_sitter_powershell = pytest.importorskip("tree_sitter_powershell")

PS1 = REPO_ROOT / "installer" / "windows" / "install.ps1"
RECORDINGS = Path(__file__).parent / "py_0p"


def _parse(source: bytes):
    parser = tree_sitter.Parser(tree_sitter.Language(tree_sitter_powershell.language()))
    return parser.parse(source).root_node


def _errors(node) -> list[str]:
    found = [f"{node.type} at line {node.start_point[0] + 1}"] if (
        node.type == "ERROR" or node.is_missing) else []
    for child in node.children:
        found += _errors(child)
    return found


def _nodes(node, kind: str):
    if node.type == kind:
        yield node
    for child in node.children:
        yield from _nodes(child, kind)


def _assigned(name: str) -> str:
    """The literal a top-level `$name = ...` assigns, read from the syntax tree."""
    source = PS1.read_bytes()
    for node in _nodes(_parse(source), "assignment_expression"):
        left, _, right = node.children[:3]
        if source[left.start_byte:left.end_byte].decode() == f"${name}":
            value = source[right.start_byte:right.end_byte].decode()
            return value[1:-1].replace("''", "'") if value.startswith("'") else value
    raise AssertionError(f"install.ps1 assigns no ${name}")


def test_install_ps1_parses():
    assert _errors(_parse(PS1.read_bytes())) == []


def test_the_parse_check_catches_a_broken_script():
    broken = PS1.read_bytes().replace(b"function Find-Python {", b"function Find-Python {{", 1)
    assert _errors(_parse(broken))


def _pick(listing: str) -> list[str]:
    """install.ps1's Get-PythonCandidates: lines matching $PyListPattern whose tag matches
    $PyTagAllowed and minor >= $PyMinMinor, newest first. .NET's (?<name>) is Python's (?P<name>)."""
    line_pattern = re.compile(_assigned("PyListPattern").replace("(?<", "(?P<"))
    tag_allowed = re.compile(_assigned("PyTagAllowed"), re.IGNORECASE)  # -match ignores case
    min_minor = int(_assigned("PyMinMinor"))
    found = []
    for line in listing.splitlines():
        m = line_pattern.search(line)
        if m and int(m["minor"]) >= min_minor and tag_allowed.search(m["tag"]):
            found.append((int(m["minor"]), m["path"]))
    return [path for _, path in sorted(found, key=lambda f: -f[0])]


@pytest.mark.parametrize(("recording", "expected"), [
    ("launcher311_two.txt", [r"C:\Users\ann\AppData\Local\Programs\Python\Python312\python.exe",
                             r"C:\Users\ann\AppData\Local\Programs\Python\Python311\python.exe"]),
    # 3.14 first; not the free-threaded 3.13t, 32-bit, arm64, 3.10 or Anaconda's tag.
    ("launcher_mixed.txt", [r"C:\Users\ann\AppData\Local\Python\pythoncore-3.14-64\python.exe",
                            r"C:\Users\ann\AppData\Local\Programs\Python\Python313\python.exe"]),
    ("launcher_old.txt", [r"C:\Program Files\Python311\python.exe"]),  # a path with a space
    ("store.txt", [(r"C:\Users\ann\AppData\Local\Microsoft\WindowsApps"
                    r"\PythonSoftwareFoundation.Python.3.12_qbz5n2kfra8p0\python.exe")]),
    ("too_old.txt", []),
    ("none.txt", []),
])
def test_python_candidates_from_py_0p(recording, expected):
    listing = (RECORDINGS / recording).read_bytes().decode("utf-8")
    assert _pick(listing) == expected


def test_native_commands_run_only_through_invoke_native():
    """A stderr line of a native command must not become a terminating error under Windows
    PowerShell 5.1 with $ErrorActionPreference = "Stop": every `& exe` call is inside
    Invoke-Native, which lowers the preference for its own scope, and nothing uses 2>$null."""
    source = PS1.read_bytes()
    text = source.decode()
    assert '$ErrorActionPreference = "Stop"' in text and "2>$null" not in text
    functions = {}
    for node in _nodes(_parse(source), "function_statement"):
        body = source[node.start_byte:node.end_byte].decode()
        functions[re.match(r"function\s+([\w-]+)", body)[1]] = body
    native = functions["Invoke-Native"]
    assert '$ErrorActionPreference = "Continue"' in native and "2>&1" in native
    calls = [line.strip() for line in text.splitlines() if re.search(r"(^|[\s(|])& \$", line)]
    assert calls and all(c in native for c in calls), calls


def test_failures_reach_strata_iss_and_torch_is_pinned():
    text = PS1.read_text()
    fail = text[text.index("function Fail"):text.index("function Say")]
    assert "[IO.File]::WriteAllText($ErrorFile, $Message)" in fail and "exit 1" in fail
    ci_torch = re.search(r"torch==([\d.]+)", (REPO_ROOT / ".ci" / "run").read_text())[1]
    assert re.search(r'\[string\]\$TorchVersion = "([\d.]+)"', text)[1] == ci_torch
    assert '"torch==$TorchVersion", "--index-url", $TorchIndexUrl' in text  # the CUDA build
    assert "Test-NvidiaDriver" in text
