"""Fetch the pinned uv.exe that strata.iss bundles: uv's win_amd64 wheel from PyPI (checked
against its pinned SHA-256), its uv.exe unpacked to dist/uv.exe.

    python installer/windows/fetch_uv.py [--wheel PATH] [--out DIR]

Runs on any platform with pip; --wheel takes an already downloaded wheel instead.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

UV_VERSION = "0.13.9"
# The SHA-256 of uv-0.13.9-py3-none-win_amd64.whl on PyPI.
UV_WHEEL_SHA256 = "6a44b2ed8111d2f60d2b92627c5dccda3f7ed7570b18ce115e569cd68c28246b"
UV_WHEEL = f"uv-{UV_VERSION}-py3-none-win_amd64.whl"
REPO_ROOT = Path(__file__).resolve().parents[2]


def download_wheel(folder: Path) -> Path:
    """The pinned wheel, downloaded by pip into folder."""
    subprocess.run([sys.executable, "-m", "pip", "download", f"uv=={UV_VERSION}",
                    "--only-binary=:all:", "--platform", "win_amd64", "--no-deps",
                    "--disable-pip-version-check", "-q", "-d", str(folder)], check=True)
    return folder / UV_WHEEL


def extract_uv(wheel: Path, out: Path) -> Path:
    """out/uv.exe from the wheel, after checking the wheel's SHA-256 against the pin."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != UV_WHEEL_SHA256:
        raise SystemExit(f"fetch_uv.py: {wheel.name} has SHA-256 {digest}, not the pinned "
                         f"{UV_WHEEL_SHA256}")
    out.mkdir(parents=True, exist_ok=True)
    target = out / "uv.exe"
    with zipfile.ZipFile(wheel) as archive:
        target.write_bytes(archive.read(f"uv-{UV_VERSION}.data/scripts/uv.exe"))
    return target


def main() -> None:
    """Command line: see the module's docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help=f"an already downloaded {UV_WHEEL}")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "dist")
    args = parser.parse_args()
    if args.wheel:
        print(extract_uv(args.wheel, args.out))
        return
    with tempfile.TemporaryDirectory() as folder:
        print(extract_uv(download_wheel(Path(folder)), args.out))


if __name__ == "__main__":
    main()
