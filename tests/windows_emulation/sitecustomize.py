"""Windows' API differences, emulated on Linux for the code of this repository.

On PYTHONPATH (`.ci/run` does it: PYTHONPATH=tests/windows_emulation), Python imports this at
start-up, in the test process and in every engine process it spawns. From then on, modules of
this repository (strata/ and tests/) that import `os`, `signal`, `mmap` or `select` get views
of them with what Windows lacks taken away:

- mmap: no MAP_*/PROT_*/MADV_* constants, no flags/prot arguments, no madvise();
- select.select() raises WinError 10038 on anything but a socket (a multiprocessing pipe);
- os: no fork, killpg, setsid, process groups, getuid and the other POSIX-only calls;
- signal: only the signals Windows has (no SIGKILL, SIGSTOP, SIGCONT, SIGHUP, SIGALRM, ...);
- with STRATA_EMULATE_NO_TRITON=1, no Triton at all (Windows without triton-windows, where
  PyTorch pulls none): `import triton` fails and importlib finds no spec, for every module.

The standard library, pytest and third-party packages keep the real modules, as they have
their own Windows implementations there. sys.platform and path syntax stay Linux's: the
branches taken on "win32" are unit-tested by patching the module's platform check instead.
"""

from __future__ import annotations

import builtins
import mmap as _mmap
import os as _os
import select as _select
import signal as _signal
import socket as _socket
import stat as _stat
import sys as _sys
import types

_REPO = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
_OURS = (_os.path.join(_REPO, "strata") + _os.sep, _os.path.join(_REPO, "tests") + _os.sep)

_OS_MISSING = {
    "fork", "forkpty", "register_at_fork", "killpg", "setsid", "getsid", "getpgid", "getpgrp",
    "setpgid", "setpgrp", "getuid", "geteuid", "getgid", "getegid", "getgroups", "setuid",
    "setgid", "seteuid", "setegid", "chown", "fchown", "lchown", "fchmod", "lchmod", "mkfifo",
    "mknod", "uname", "nice", "getloadavg", "sysconf", "statvfs", "fstatvfs", "sync", "pipe2",
    "posix_spawn", "posix_spawnp", "sched_getaffinity", "sched_setaffinity", "getpriority",
    "setpriority", "openpty", "wait3", "wait4", "WNOHANG", "O_NOFOLLOW", "O_DIRECTORY",
    "O_CLOEXEC", "O_NONBLOCK", "getresuid", "getresgid", "initgroups", "ttyname", "ctermid",
}
_SIGNAL_KEPT = {  # what Python's signal module has on Windows
    "SIGABRT", "SIGFPE", "SIGILL", "SIGINT", "SIGSEGV", "SIGTERM", "SIG_DFL", "SIG_IGN",
    "NSIG", "Signals", "Handlers", "default_int_handler", "getsignal", "signal", "raise_signal",
    "set_wakeup_fd", "strsignal", "valid_signals",
}
_MMAP_KEPT = {"ACCESS_DEFAULT", "ACCESS_READ", "ACCESS_WRITE", "ACCESS_COPY", "PAGESIZE",
              "ALLOCATIONGRANULARITY", "error"}
WSAENOTSOCK = 10038


def _view(module: types.ModuleType, keep) -> types.ModuleType:
    view = types.ModuleType(module.__name__, module.__doc__)
    view.__dict__.update({k: v for k, v in vars(module).items() if keep(k)})
    return view


class _WindowsMmap(_mmap.mmap):
    """mmap's Windows signature: (fileno, length, tagname=None, access=..., offset=0)."""

    def __new__(cls, fileno, length, tagname=None, access=_mmap.ACCESS_DEFAULT, offset=0):
        return super().__new__(cls, fileno, length, access=access, offset=offset)

    def __getattribute__(self, name):
        if name == "madvise":
            raise AttributeError("'mmap.mmap' object has no attribute 'madvise' (Windows)")
        return super().__getattribute__(name)


def _windows_select(rlist, wlist, xlist, timeout=None):
    for item in (*rlist, *wlist, *xlist):
        fd = item if isinstance(item, int) else item.fileno()
        if not _stat.S_ISSOCK(_os.fstat(fd).st_mode):
            raise OSError(WSAENOTSOCK, "An operation was attempted on something that is not "
                                       "a socket")
    return _select.select(rlist, wlist, xlist, timeout)


_VIEWS = {
    "os": _view(_os, lambda k: k not in _OS_MISSING),
    "signal": _view(_signal, lambda k: k in _SIGNAL_KEPT or k.startswith("__")),
    "mmap": _view(_mmap, lambda k: k in _MMAP_KEPT or k.startswith("__")),
    "select": _view(_select, lambda k: k in {"select", "error"} or k.startswith("__")),
}
_VIEWS["signal"].SIGBREAK = 21  # Windows' Ctrl-Break
_VIEWS["signal"].CTRL_C_EVENT, _VIEWS["signal"].CTRL_BREAK_EVENT = 0, 1
_VIEWS["mmap"].mmap = _WindowsMmap
_VIEWS["select"].select = _windows_select
assert _socket  # sockets pass _windows_select, as on Windows

_real_import = builtins.__import__


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    module = _real_import(name, globals, locals, fromlist, level)
    top = name.partition(".")[0]
    # `import os` and `import os.path` bind the top module; `from os.path import x` does not.
    if level == 0 and top in _VIEWS and (name == top or not fromlist) and globals is not None:
        path = globals.get("__file__") or ""
        if path.startswith(_OURS):
            return _VIEWS[top]
    return module


builtins.__import__ = _import
if _os.environ.get("STRATA_EMULATE_NO_TRITON") == "1":
    # None in sys.modules: `import triton` raises ModuleNotFoundError and find_spec answers
    # None, as where the package is not installed (torch's own checks see the same).
    _sys.modules["triton"] = None  # type: ignore[assignment]
_os.environ.setdefault("USERNAME", "strata")  # Windows always has it; getpass reads it
_os.environ["STRATA_WINDOWS_EMULATION"] = "1"  # tests that must skip say why
