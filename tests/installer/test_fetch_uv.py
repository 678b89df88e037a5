"""installer/windows/fetch_uv.py: the uv.exe that strata.iss bundles comes only from the wheel
whose hash is pinned. (The real download and unpacking run in test_inno_wine.py.)"""

from __future__ import annotations

import zipfile

import pytest
from uv_helpers import fetch_uv


def test_a_wheel_with_another_hash_is_refused(tmp_path):
    wheel = tmp_path / fetch_uv.UV_WHEEL
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"uv-{fetch_uv.UV_VERSION}.data/scripts/uv.exe", b"MZ not uv")
    with pytest.raises(SystemExit, match="not the pinned"):
        fetch_uv.extract_uv(wheel, tmp_path / "dist")
    assert not (tmp_path / "dist" / "uv.exe").exists()
