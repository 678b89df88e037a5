"""Server paths never reach HTTP clients: absolute paths in messages and status become file names.

The model file, snapshot directory and home directory say things about the server that a client
has no business knowing (issue 17: /props, /v1/status and error texts showed them). The tray and
the CLI read the service directly and still show full paths locally.
"""

from __future__ import annotations

import os
import re
from typing import Any

# An absolute path: POSIX ('/home/u/x.gguf', not the '/v1/models' of a route, see _is_server_path)
# or Windows ('C:\\models\\x.gguf'). Not preceded by a word character, '.', ':' or '/', so the
# path part of a URL ('http://host/v1') is left alone.
_PATH = re.compile(r"(?<![\w.:/\\])(?:/|[A-Za-z]:[\\/])[^\s'\"`<>|;,()\[\]{}]*")


def _is_server_path(path: str) -> bool:
    """Windows drive paths always; POSIX paths whose first directory exists on this machine.

    Routes (/v1, /slots, /health) are no directories here, so texts naming them stay whole.
    """
    if not path.startswith("/"):
        return True
    first = path.lstrip("/").split("/", 1)[0]
    return bool(first) and "/" in path.lstrip("/") and os.path.isdir("/" + first)


def file_name(path: str) -> str:
    """The last component of a path ('/a/b/m.gguf' -> 'm.gguf', 'C:\\m\\x' -> 'x')."""
    trimmed = path.rstrip("/\\")
    return re.split(r"[/\\]", trimmed)[-1] or trimmed


def redact_text(text: str) -> str:
    """text with every absolute server path replaced by its file name."""
    if "/" not in text and "\\" not in text:
        return text
    return _PATH.sub(lambda m: file_name(m.group(0)) if _is_server_path(m.group(0))
                     else m.group(0), text)


def redact(value: Any) -> Any:
    """A JSON-like value with redact_text applied to every string in it (keys stay)."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {key: redact(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(item) for item in value]
    if isinstance(value, os.PathLike):
        return file_name(os.fspath(value))
    return value
