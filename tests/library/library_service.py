"""The pool's side of a pull over the API fake, and the NDJSON reader, for the /api/pull tests."""

from __future__ import annotations

import json
from pathlib import Path

from tests.api.fake_service import FakeService


class LibraryService(FakeService):
    """The pool's side of a pull (POOL_CONTRACT.md: models_dir, rescan) over the API fake."""

    def __init__(self, models_dir: Path):
        super().__init__(text=None)
        self.models_dir = models_dir
        self.num_rescans = 0

    async def rescan(self) -> list:
        self.num_rescans += 1
        return []


def ndjson(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]
