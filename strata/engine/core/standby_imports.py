"""What a standby engine process imports while it waits for a Load, without a CUDA context.

Engine.warm_imports is this function: the process (process.py) runs it on a thread and
stops it when a load comes.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading

import torch

from strata.engine.core.engine_config import EngineConfig


def warm_imports(config: EngineConfig | None = None,
                 stop: threading.Event | None = None) -> list[str]:
    """For a standby process: import the modules a load imports on its critical path
    without creating a CUDA context, so the next load pays only for the model: the
    loaders and model files (whose attention imports torch._dynamo: seconds), and for a
    GPU load torch.compile's inductor, the fast decoder and the kernels, and the source
    hashes torch.compile and Triton key their caches with (fast/compiler_keys.py).

    The process runs this on a thread while it waits (process.py), so what a load needs
    first comes first: Strata's modules (none imports the compiler), then the compiler.
    Once `stop` is set it returns after the module it is importing: a load stops it
    first, because two threads importing one module graph can each meet a module the
    other has half run (a cycle of import locks; run 25b saw it on the H200)."""
    packages = ["strata.engine.core.loader", "strata.engine.core.models"]
    compiler: list[str] = []
    if getattr(config, "device", "auto") != "cpu" and torch.cuda.is_available():
        compiler = ["torch._dynamo", "torch._inductor.compile_fx"]
        packages += ["strata.engine.core.fast", "strata.engine.core.quant"]
    names: list[str] = []

    def stopped() -> bool:
        return stop is not None and stop.is_set()

    for package in packages:
        if stopped():
            return []  # the packages' modules are listed, none of them imported yet
        module = importlib.import_module(package)
        names += [info.name for info in pkgutil.iter_modules(module.__path__, package + ".")]
    names += compiler
    for index, name in enumerate(names):
        if stopped():
            return names[:index]
        importlib.import_module(name)
    if "torch._dynamo" in names and not stopped():
        from strata.engine.core.fast.compiler_keys import warm_compiler_keys

        names += warm_compiler_keys(stop)  # seconds of hashing, no CUDA context needed
    return names
