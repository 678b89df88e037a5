"""Find the examples in the user docs: fenced blocks, their skip markers, the commands in them.

Conventions the docs follow (and this parser enforces):
- every ```bash block (also sh, shell, console) holds `strata ...` or `curl ...` commands only;
- `<!-- docs-test: skip (reason) -->` on the line before a fence skips that block;
- ```python blocks are run, ```toml blocks are loaded as config files, ```json is parsed;
- ```text and unlabelled blocks are output or diagrams and are not checked;
- any other language (powershell, ...) must carry a skip marker.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
# The pages a user reads, in the order a user would run their examples.
DOC_PAGES = ("getting-started.md", "api.md", "sharing-the-gpu.md", "configuration.md",
             "troubleshooting.md")
SHELL_LANGS = ("bash", "sh", "shell", "console")
CHECKED_LANGS = (*SHELL_LANGS, "python", "toml", "json")
UNCHECKED_LANGS = ("text", "")
DOCS_PORT = 8080

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<body>.*?)-->\s*$")
_SKIP = re.compile(r"^\s*skip\s*\((?P<reason>[^)]+)\)\s*$")
_LOCAL_URL = re.compile(rf"(?:127\.0\.0\.1|localhost):{DOCS_PORT}\b")


class DocFormatError(ValueError):
    """A doc page breaks the example conventions above."""


@dataclass(frozen=True)
class Block:
    """One fenced block of a doc page."""

    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    skip_reason: str | None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass(frozen=True)
class Command:
    """One shell command of a block, split like a POSIX shell would."""

    block: Block
    argv: tuple[str, ...]
    text: str


def _skip_reason(lines: list[str], fence_index: int, where: str) -> str | None:
    i = fence_index - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    if i < 0:
        return None
    marker = _MARKER.match(lines[i])
    if not marker:
        return None
    skip = _SKIP.match(marker.group("body"))
    if not skip:
        raise DocFormatError(f"{where}: marker {lines[i].strip()!r} is not "
                             "'<!-- docs-test: skip (reason) -->'")
    return skip.group("reason").strip()


def read_blocks(page: str, text: str | None = None) -> list[Block]:
    """Every fenced block of a page (text given, or read from docs/)."""
    if text is None:
        text = (DOCS_DIR / page).read_text(encoding="utf-8")
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, lang, start = fence.group("indent"), fence.group("lang").lower(), i
        body = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i].removeprefix(indent))
            i += 1
        if i == len(lines):
            raise DocFormatError(f"{page}:{start + 1}: the ``` block is never closed")
        where = f"{page}:{start + 1}"
        blocks.append(Block(page, start + 1, lang, "\n".join(body) + "\n",
                            _skip_reason(lines, start, where)))
        i += 1
    return blocks


def split_commands(block: Block) -> list[Command]:
    """The commands of a shell block: `\\` continues a line, and so does an open quote."""
    commands, pending = [], ""
    for line in block.text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        if argv:
            commands.append(Command(block, tuple(argv), pending.strip()))
        pending = ""
    if pending.strip():
        raise DocFormatError(f"{block.where}: unterminated command {pending.strip()[:60]!r}")
    return commands


def rewrite_port(text: str, port: int) -> str:
    """Point the docs' http://127.0.0.1:8080 (or localhost:8080) at the test server."""
    return _LOCAL_URL.sub(f"127.0.0.1:{port}", text)


def mentions_local_server(text: str) -> bool:
    return _LOCAL_URL.search(text) is not None


def all_blocks() -> list[Block]:
    """The blocks of every user doc page, checked against the conventions."""
    blocks = [block for page in DOC_PAGES for block in read_blocks(page)]
    for block in blocks:
        if block.skip_reason is None and block.lang not in (*CHECKED_LANGS, *UNCHECKED_LANGS):
            raise DocFormatError(f"{block.where}: ```{block.lang} blocks cannot be run here; "
                                 "mark it <!-- docs-test: skip (reason) -->")
    return blocks
