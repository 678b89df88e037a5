"""Names from outside (a repository id typed by a user or sent to /api/pull, the file names and
the commit in a hub's listing) checked before any of them becomes a path in the library.

A hub is whatever HF_ENDPOINT names, so a listing is untrusted input: a file called
`../../x.gguf`, `/etc/x.gguf`, `a\\..\\x.gguf` (a separator on Windows) or `C:x.gguf` would be
written outside the library. Every name must be a relative path of plain components that
stays below the library on Linux, macOS and Windows alike; anything else is refused with one
line, before a folder is created.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from strata.library.pull_errors import BadListingError, PullError

# huggingface_hub's rule (utils/_validators.py, the hub's own): OWNER/REPO, each of ASCII
# letters, digits, '-', '_', '.', starting and ending with a letter, digit or '_', at most 96
# characters, no '--' or '..', not ending in '.git'. A name that passes is one plain path
# component on every file system.
_REPO_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?", re.ASCII)
_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # a git commit id: SHA-1 or SHA-256
# Characters no file name from a hub may hold: control characters (NUL ends a C path), the
# Windows separator, and ':' (a drive on Windows, a stream of a file on NTFS).
_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f\\:]")


def check_repo_id(repo: str) -> None:
    """Raise PullError unless repo is OWNER/REPO as the hub spells repository ids."""
    parts = repo.split("/")
    if len(parts) != 2 or not all(_REPO_PART.fullmatch(p) for p in parts) or \
            "--" in repo or ".." in repo or repo.endswith(".git"):
        raise PullError(f"{repo!r} is not a hub repository id: OWNER/REPO of letters, digits, "
                        "'-', '_' and '.' (at most 96 each, no '--' or '..', not starting or "
                        "ending with '-' or '.'), e.g. bartowski/Qwen_Qwen3-8B-GGUF")


def check_commit(commit: str | None, repo: str) -> None:
    """Raise BadListingError unless commit (what each file URL is pinned to) is a git id."""
    if commit is not None and not _COMMIT.fullmatch(commit):
        raise BadListingError(f"the hub's listing of {repo} gives {commit!r} as its commit, "
                              "which is not a git commit id; refused (is HF_ENDPOINT a hub?)")


def check_file_name(name: str, repo: str) -> str:
    """name, if it is a relative path of plain components that stays inside a folder on every
    file system; else BadListingError naming the file."""
    problem = _file_name_problem(name)
    if problem is not None:
        raise BadListingError(f"the hub's listing of {repo} names a file {name!r}, which "
                              f"{problem}; refused (is HF_ENDPOINT a hub you trust?)")
    return name


def _file_name_problem(name: str) -> str | None:
    if not name:
        return "is empty"
    if _FORBIDDEN.search(name):
        return "holds a control character, '\\' or ':'"
    if name.startswith("/"):
        return "is an absolute path"
    for part in name.split("/"):
        if part in ("", ".", ".."):
            return "has an empty, '.' or '..' component"
        # Windows drops trailing dots and spaces: '.. ' would mean '..' there
        if part[-1] in ". ":
            return "has a component ending in '.' or ' '"
    return None


def inside(root: Path, name: str, repo: str) -> Path:
    """root/name for a file name of repo's listing; refused unless the path, normalized, lies
    below root (a second line behind check_file_name's rules)."""
    path = root / check_file_name(name, repo)
    normal_root = Path(os.path.normpath(root))
    normal_path = Path(os.path.normpath(path))
    if normal_path == normal_root or not normal_path.is_relative_to(normal_root):
        raise BadListingError(f"the hub's listing of {repo} names a file {name!r}, which "
                              "leaves the library; refused")
    return path
