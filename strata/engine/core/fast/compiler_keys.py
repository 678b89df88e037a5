"""The cache keys torch.compile and Triton hash once per process, computed ahead of a load.

Before its first compile or cache lookup, each process hashes torch's source files
(inductor's `torch_key`, for its FX-graph and AOT caches) and Triton's compiler, backends
and its ~500 MB libtriton (`triton_key`, for every kernel's cache key and the autotuner's
disk cache): about 0.6 s and 1.1 s on the development machine, paid on a load's critical
path even when every kernel is already compiled on disk. Neither needs a CUDA context, so
a standby process (standby_imports.py) computes both while it waits; the results stay in
those libraries' own in-process caches.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


def warm_compiler_keys(stop: threading.Event | None = None) -> list[str]:
    """Compute torch's and Triton's source hashes now; the names of those computed. A
    library without the function (another version) is skipped with a debug line: the load
    then computes what it needs, as before. Once `stop` is set, the next hash is left to
    the load (standby_imports.py says why)."""
    done = []
    for name, compute in (("torch_key", _torch_key), ("triton_key", _triton_key)):
        if stop is not None and stop.is_set():
            break
        try:
            compute()
        except Exception as exc:  # noqa: BLE001 - an optimisation: never fail a standby
            log.debug("%s not computed ahead (%s)", name, exc)
            continue
        done.append(name)
    return done


def _torch_key() -> None:
    from torch._inductor.codecache import torch_key

    torch_key()


def _triton_key() -> None:
    # Triton's own function (lru-cached): the one its JIT, its autotuner and inductor's
    # triton_compat all call.
    from triton.runtime.cache import triton_key

    triton_key()
