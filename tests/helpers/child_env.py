"""The environment of a child Python that a test starts to run this checkout's code as a
user would: the checkout on PYTHONPATH, and none of the switches test modules set for the
whole pytest process."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Test modules that run Triton on the CPU set TRITON_INTERPRET at import, and some pick a
# path by STRATA_QUANTIZED: a child inheriting them would interpret its kernels (minutes) or
# take a path the engine would not.
TEST_SWITCHES = ("TRITON_INTERPRET", "STRATA_QUANTIZED")


def child_env(**extra: str) -> dict[str, str]:
    """os.environ without TEST_SWITCHES, REPO first on PYTHONPATH, then `extra`."""
    env = {key: value for key, value in os.environ.items() if key not in TEST_SWITCHES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return env | extra
