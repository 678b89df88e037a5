"""Helpers for the live docs server: where `strata` is, a free port, the server handle."""

from __future__ import annotations

import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LiveServer:
    port: int
    env: dict[str, str]
    log_path: Path

    def log_tail(self, num_chars: int = 2000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]


def strata_script() -> str:
    """The `strata` console script of the running interpreter's environment."""
    script = Path(sys.executable).parent / "strata"
    return str(script) if script.exists() else shutil.which("strata") or "strata"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
