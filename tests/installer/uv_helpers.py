"""What the installer test needs around uv under wine: the pinned real uv.exe, the shim that
lets it start on wine 8, the stand-in uv.exe, and a package index and Python archive served on
127.0.0.1 (uv's mirror settings point there).

The shim: uv.exe imports ProcessPrng from bcryptprimitives.dll, which wine 8 lacks (wine 9 has
it), so the test puts a bcryptprimitives.dll beside the real uv.exe whose ProcessPrng calls
advapi32's RtlGenRandom (SystemFunction036). It exists only in the test's wine prefix; the setup
does not ship it. Missing mingw or a failed download fails the test, as missing wine does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import shutil
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from install_helpers import REPO_ROOT
from wine_helpers import unavailable

MINGW_GCC = "x86_64-w64-mingw32-gcc"  # Debian: gcc-mingw-w64-x86-64-win32
HERE = Path(__file__).parent
# The name uv's python-build-standalone metadata gives the Windows CPython 3.12 archive.
PYTHON_BUILD = "20251010"
PYTHON_ARCHIVE = f"cpython-3.12.12+{PYTHON_BUILD}-x86_64-pc-windows-msvc-install_only_stripped.tar.gz"
PYTHON_KEY = "cpython-3.12.12-windows-x86_64-none"
UPSTREAM = "https://github.com/astral-sh/python-build-standalone/releases/download"

_BCRYPTPRIMITIVES_C = r"""
#include <windows.h>
BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);
BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T length) {
    while (length) {
        ULONG part = length > 0x10000000 ? 0x10000000 : (ULONG)length;
        if (!SystemFunction036(data, part)) return FALSE;
        data += part;
        length -= part;
    }
    return TRUE;
}
"""


def _fetch_uv_module():
    spec = importlib.util.spec_from_file_location(
        "fetch_uv", REPO_ROOT / "installer" / "windows" / "fetch_uv.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fetch_uv = _fetch_uv_module()


def _mingw(source: Path, output: Path, *flags: str) -> Path:
    gcc = shutil.which(MINGW_GCC)
    if gcc is None:
        unavailable(f"{MINGW_GCC} is missing (Debian: gcc-mingw-w64-x86-64-win32)")
    done = subprocess.run([gcc, "-O2", "-s", "-Wall", "-o", str(output), str(source), *flags],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return output


def build_uv_standin(out: Path) -> Path:
    """uv_standin.c compiled to out/uv.exe."""
    out.mkdir(parents=True, exist_ok=True)
    return _mingw(HERE / "uv_standin.c", out / "uv.exe", "-lwininet")


def real_uv(cache: Path, into: Path) -> Path:
    """The pinned uv.exe (the wheel downloaded once into cache) in into/, with the shim."""
    wheel = cache / fetch_uv.UV_WHEEL
    if not wheel.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        try:
            fetch_uv.download_wheel(cache)
        except subprocess.CalledProcessError as error:
            unavailable(f"pip download uv=={fetch_uv.UV_VERSION} failed ({error})")
    uv = fetch_uv.extract_uv(wheel, into)
    source = into / "bcryptprimitives.c"
    source.write_text(_BCRYPTPRIMITIVES_C)
    _mingw(source, into / "bcryptprimitives.dll", "-shared", "-ladvapi32")
    source.unlink()
    return uv


def python_archive(standin: Path) -> bytes:
    """A tar.gz in python-build-standalone's install_only layout (python/...), whose
    python.exe and pythonw.exe are copies of the stand-in: no Windows CPython can be fetched."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name in ("python.exe", "pythonw.exe"):
            archive.add(standin, f"python/{name}")
        for name, text in (("python/Lib/os.py", b"# stand-in\n"), ("python/LICENSE.txt", b"PSF\n")):
            info = tarfile.TarInfo(name)
            info.size = len(text)
            archive.addfile(info, io.BytesIO(text))
    return buffer.getvalue()


def serve_folder(root: Path, standin: Path) -> None:
    """The server's files: the Python archive under its mirror path, uv's downloads list
    (UV_PYTHON_DOWNLOADS_JSON_URL) naming it with its hash, and a simple index with torch."""
    archive = python_archive(standin)
    (root / "pbs" / PYTHON_BUILD).mkdir(parents=True)
    (root / "pbs" / PYTHON_BUILD / PYTHON_ARCHIVE).write_bytes(archive)
    downloads = {PYTHON_KEY: {
        "name": "cpython", "arch": {"family": "x86_64", "variant": None}, "os": "windows",
        "libc": "none", "major": 3, "minor": 12, "patch": 12, "prerelease": "",
        "url": f"{UPSTREAM}/{PYTHON_BUILD}/{PYTHON_ARCHIVE}",
        "sha256": hashlib.sha256(archive).hexdigest(), "variant": None, "build": PYTHON_BUILD}}
    (root / "python-downloads.json").write_text(json.dumps(downloads))
    (root / "simple" / "torch").mkdir(parents=True)
    (root / "simple" / "torch" / "index.html").write_text(
        '<a href="torch-2.13.0-cp312-cp312-win_amd64.whl">torch-2.13.0-cp312-cp312-win_amd64.whl</a>\n')


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def http_server(root: Path) -> Iterator[str]:
    """root served on 127.0.0.1; yields the base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
