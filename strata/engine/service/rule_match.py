"""Which process a rule pattern means: what it runs, not every word of its command line.

By default (match = "exe") a pattern is compared with the process's name, its executable path,
argv[0], and, for a Python interpreter, the script or module it runs (the script resolved
against the process's working directory). So `*/comfyui/main.py` matches `python main.py`
started in ~/ComfyUI, but not `vim ~/ComfyUI/main.py` or `tail -f comfyui.log`. With
match = "cmdline" the whole command line is compared too (the old, looser behaviour).

Patterns are globs, compared in lower case with `\\` read as `/`. A pattern without a `/`
is compared with the base name of each path ("blender" matches /opt/blender-4.2/blender).
"""

from __future__ import annotations

import fnmatch
import ntpath
import posixpath
import re
from collections.abc import Iterable

from strata.engine.service.process_watch import ProcessInfo

MATCH_MODES = ("exe", "cmdline")
_PYTHON = re.compile(r"^(python|pythonw|py)(\d+(\.\d+)*)?(\.exe)?$")
# Interpreter options that take the next argument as their value.
_OPTIONS_WITH_VALUE = {"-X", "-W", "-Q", "--check-hash-based-pycs"}


def _norm(text: str) -> str:
    return text.strip().lower().replace("\\", "/")


def _base(path: str) -> str:
    return posixpath.basename(path.rstrip("/"))


def is_python(proc: ProcessInfo) -> bool:
    """The process is a Python interpreter (by executable or argv[0] base name)."""
    names = [_base(_norm(proc.exe)), _base(_norm(proc.args[0])) if proc.args else "",
             _norm(proc.name)]
    return any(_PYTHON.match(name) for name in names if name)


def program(proc: ProcessInfo) -> str:
    """For a Python interpreter, the script it runs (absolute where the cwd is known) or the
    module of `-m`; "" for anything else, or for `-c` code."""
    if not is_python(proc):
        return ""
    args = list(proc.args[1:])
    while args:
        arg = args.pop(0)
        if arg in ("-c", "-"):
            return ""
        if arg == "-m":
            return args[0] if args else ""
        if arg in _OPTIONS_WITH_VALUE:
            if args:
                args.pop(0)
            continue
        if arg.startswith("-"):
            if arg.startswith("-m") and len(arg) > 2:  # -mmodule
                return arg[2:]
            continue
        return _resolve(arg, proc.cwd)
    return ""


def _resolve(script: str, cwd: str) -> str:
    is_absolute = script.startswith("/") or ntpath.isabs(script)
    if is_absolute or not cwd:
        return script
    joined = ntpath.join(cwd, script) if ("\\" in cwd or ":" in cwd[:2]) else posixpath.join(
        cwd, script)
    return posixpath.normpath(joined.replace("\\", "/"))


def match_fields(proc: ProcessInfo, mode: str = "exe") -> list[str]:
    """The normalized texts a pattern is compared with, for a match mode."""
    fields = [_norm(proc.name), _norm(proc.exe)]
    if proc.args:
        fields.append(_norm(proc.args[0]))
    fields.append(_norm(program(proc)))
    if mode == "cmdline":
        fields.append(_norm(proc.cmdline or " ".join(proc.args)))
    return [f for f in dict.fromkeys(fields) if f]


def matches(patterns: Iterable[str], proc: ProcessInfo, mode: str = "exe") -> bool:
    """True when a glob fits what proc runs (see the module docstring); any case."""
    fields = match_fields(proc, mode)
    bases = [_base(f) for f in fields]
    for pattern in patterns:
        pat = _norm(pattern)
        if not pat:
            continue
        texts = fields if "/" in pat else fields + bases
        if any(fnmatch.fnmatchcase(text, pat) for text in texts):
            return True
    return False
