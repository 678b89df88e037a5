"""An engine process's standby: what it has ready before its first Load.

Right after Ready the process imports the engine module (torch), so the first Load pays only
for the model. Then what a GPU load would import (torch.compile's compiler, the kernels:
standby_imports.py), still without a CUDA context, on a thread of its own: a Load that comes
meanwhile stops it after its current module instead of waiting seconds for the compiler
(issue 18: load from standby), and a load that has run before needs no compiler until ready.
No torch here: the host side imports process.py, which imports this.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from strata.engine.core.error_codes import one_line

WARM_THREAD_NAME = "strata-warm-imports"  # the standby's import warm-up (standby_imports.py)

log = logging.getLogger("strata.engine.process")


def resolve_factory(spec: str) -> Callable[[Any], Any]:
    """Import "module:callable" (dots after the colon walk attributes) and return the callable."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"engine factory {spec!r} must look like 'package.module:callable'")
    target: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"engine factory {spec!r} is not callable")
    return target


class Standby:
    """The engine factory a process imported, and the thread warming a load's imports."""

    def __init__(self, factory_spec: str):
        self.factory_spec = factory_spec
        self._factory: Callable[[Any], Any] | None = None
        self._factory_error: BaseException | None = None
        self._warming: threading.Thread | None = None
        self._warm_stop = threading.Event()  # set by a load: no import runs beside it

    def start(self, config: Any) -> None:
        """Import the engine factory, then warm its imports for `config` on a thread. A
        factory that cannot be imported is reported on Load, where the host listens."""
        try:
            self._factory = resolve_factory(self.factory_spec)
        except Exception as exc:  # noqa: BLE001 - reported on Load, where the host listens
            traceback.print_exc(file=sys.stderr)
            self._factory_error = exc
        warm_imports = getattr(self._factory, "warm_imports", None)
        if warm_imports is not None:
            self._warming = threading.Thread(target=self._warm_imports,
                                             args=(warm_imports, config),
                                             name=WARM_THREAD_NAME, daemon=True)
            self._warming.start()

    def factory(self) -> Callable[[Any], Any]:
        """The engine factory for a Load; RuntimeError saying why when it could not be
        imported."""
        if self._factory is None:
            raise RuntimeError(
                f"cannot import the engine {self.factory_spec!r}: {one_line(self._factory_error)}"
            )
        return self._factory

    def _warm_imports(self, warm_imports: Callable[..., Any], config: Any) -> None:
        try:
            warm_imports(config, stop=self._warm_stop)
        except Exception:  # an optimisation: the load imports what it needs
            log.warning("warming the standby's imports failed", exc_info=True)

    def stop_warming(self) -> None:
        """Stop the standby's imports after the module in hand and wait for that. Python's
        per-module import locks let two threads importing one graph each see a module the
        other has half run (`cannot import name ... from partially initialized module`:
        the GPU tests met it in run 25b), so nothing imports beside a load."""
        warming = self._warming
        if warming is None or not warming.is_alive():
            return
        self._warm_stop.set()
        started_s = time.monotonic()
        warming.join()
        log.info("the standby's imports stopped for the load in %.2f s",
                 time.monotonic() - started_s)

    @property
    def is_warming(self) -> bool:
        """Whether the warm-up thread still imports."""
        return self._warming is not None and self._warming.is_alive()

    def info(self) -> dict[str, bool]:
        """What a process without a model has ready: the engine module (torch) imported, and
        whether CUDA was touched (it must not be: a standby holds no VRAM), and whether its
        warm-up imports (the compiler, the kernels: a thread of their own) are done."""
        torch = sys.modules.get("torch")
        is_cuda_initialized = bool(torch is not None and torch.cuda.is_initialized())
        return {
            "is_factory_imported": self._factory is not None,
            "is_torch_imported": torch is not None,
            "is_cuda_initialized": is_cuda_initialized,
            "is_compiler_imported": "torch._dynamo" in sys.modules,
            "is_warm": self._factory is not None and not self.is_warming,
        }
