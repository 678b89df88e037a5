"""The real Engine with a standby warm-up that lasts until the test says so: its
warm_imports waits for the file named by STRATA_TEST_WARM_GATE (a spawned engine process
inherits the variable), and its load reports whether that warm-up had finished, so a test
sees without timing anything whether a Load waited for the standby's imports."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from strata.engine.core.engine import Engine

GATE_ENV = "STRATA_TEST_WARM_GATE"
FACTORY = "tests.helpers.gated_warm_engine:GatedWarmEngine"
_warmed = threading.Event()


class GatedWarmEngine(Engine):
    @staticmethod
    def warm_imports(config=None) -> list[str]:
        gate = Path(os.environ[GATE_ENV])
        deadline_s = time.monotonic() + 120
        while not gate.exists() and time.monotonic() < deadline_s:
            time.sleep(0.05)
        names = Engine.warm_imports(config)
        _warmed.set()
        return names

    def load(self) -> dict:
        return {**super().load(), "was_warm_at_load": _warmed.is_set()}
