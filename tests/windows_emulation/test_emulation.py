"""The Windows emulation takes away what Windows lacks, for this repository's code only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parent.parent

# Written to a file under tests/ so that its imports count as this repository's code.
_PROBE = textwrap.dedent("""
    import mmap, os, select, signal, multiprocessing, subprocess, sys
    assert os.environ["STRATA_WINDOWS_EMULATION"] == "1"
    for name in ("MAP_PRIVATE", "MAP_ANONYMOUS", "MADV_DONTNEED", "PROT_READ"):
        assert not hasattr(mmap, name), name
    anonymous = mmap.mmap(-1, 4096)  # Windows' signature works
    assert not hasattr(anonymous, "madvise")
    try:
        mmap.mmap(-1, 4096, flags=1)
        raise AssertionError("flags= must be refused")
    except TypeError:
        pass
    for name in ("fork", "killpg", "setsid", "getpgid", "getuid"):
        assert not hasattr(os, name), name
    for name in ("SIGKILL", "SIGSTOP", "SIGCONT", "SIGHUP", "SIGALRM"):
        assert not hasattr(signal, name), name
    assert signal.SIGTERM and signal.SIGINT and signal.SIGBREAK
    reader, writer = multiprocessing.Pipe(duplex=False)
    try:
        select.select([reader.fileno()], [], [], 0)
        raise AssertionError("select on a pipe must fail")
    except OSError as exc:
        assert exc.errno == 10038, exc
    import socket
    a, b = socket.socketpair()
    assert select.select([], [a], [], 0)[1] == [a]  # sockets still work, as on Windows
    # The standard library keeps its own: subprocess can still kill a child.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    child.kill()
    assert child.wait(10) != 0
    print("emulated")
""")


def test_emulation_removes_what_windows_lacks_for_repository_code(tmp_path):
    probe = HERE / f"_probe_{os.getpid()}.py"
    probe.write_text(_PROBE)
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
        result = subprocess.run([sys.executable, str(probe)], env=env, capture_output=True,
                                text=True, timeout=60, check=False)
    finally:
        probe.unlink()
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "emulated"


def test_code_outside_the_repository_keeps_the_real_modules():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)])}
    code = "import mmap, os, signal; print(hasattr(mmap, 'MAP_PRIVATE'), hasattr(os, 'fork'))"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    assert result.stdout.split() == ["True", "True"]
