"""The real Engine with a standby warm-up that lasts until the test says so, or until a
load stops it: its warm_imports waits for the file named by STRATA_TEST_WARM_GATE (a
spawned engine process inherits the variable) or for the stop event, and its load reports
whether that warm-up had finished and whether its thread still ran, so a test sees without
timing anything what a Load did with the standby's imports."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from strata.engine.core.engine import Engine
from strata.engine.core.process_standby import WARM_THREAD_NAME

GATE_ENV = "STRATA_TEST_WARM_GATE"
FACTORY = "tests.helpers.gated_warm_engine:GatedWarmEngine"
_warmed = threading.Event()


class GatedWarmEngine(Engine):
    @staticmethod
    def warm_imports(config=None, stop: threading.Event | None = None) -> list[str]:
        gate = Path(os.environ[GATE_ENV])
        deadline_s = time.monotonic() + 120
        while not gate.exists() and time.monotonic() < deadline_s:
            if stop is not None and stop.is_set():
                return []
            time.sleep(0.05)
        names = Engine.warm_imports(config, stop)
        _warmed.set()
        return names

    def load(self) -> dict:
        is_warming = any(thread.name == WARM_THREAD_NAME and thread.is_alive()
                         for thread in threading.enumerate())
        return {**super().load(), "was_warm_at_load": _warmed.is_set(),
                "was_warming_at_load": is_warming}
