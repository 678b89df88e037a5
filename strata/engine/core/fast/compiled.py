"""PointwiseOps fused by torch.compile (Inductor), falling back to eager per function.

Apart from pointwise.py because the prefill's compiled groups include a whole MoE block
(moe_prefill.grouped_block), and moe_prefill builds on pointwise's eager functions.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from functools import partial

import torch

from strata.engine.core.fast.moe_prefill import grouped_block
from strata.engine.core.fast.pointwise import (
    PointwiseOps,
    add_rms_norm,
    gelu_mul,
    masked_softmax,
    qk_norm_rope,
    rms_norm,
    silu_mul,
    silu_mul_scale,
    sum_rows,
)

log = logging.getLogger(__name__)

_DYNAMIC_COPIES: dict[Callable, Callable] = {}


def _eager_unless_compiled(make_compiled: Callable[[], Callable], eager: Callable) -> Callable:
    """make_compiled()'s function, until torch.compile cannot give a variant (its recompile
    limit, which fullgraph makes an error, or an op this build cannot compile): from then on
    eager, with one warning, instead of failing requests.

    torch.compile is called on the first call, not here: it imports torch._dynamo (seconds),
    which a load whose compiling is deferred (deferred_compile.py) must not wait for."""
    current: list[Callable | None] = [None]
    no_variant: list[tuple[type[BaseException], ...]] = [()]

    def call(*args):
        if current[0] is None:
            from torch._dynamo.exc import (
                BackendCompilerFailed,
                FailOnRecompileLimitHit,
                Unsupported,
            )

            no_variant[0] = (FailOnRecompileLimitHit, BackendCompilerFailed, Unsupported)
            current[0] = make_compiled()
        try:
            return current[0](*args)
        except no_variant[0] as exc:
            if current[0] is eager:
                raise
            log.warning("%s: torch.compile gave no variant (%s); running it eagerly",
                        eager.__name__, str(exc).splitlines()[0][:200])
            current[0] = eager
            return eager(*args)

    return call


def _own_code(fn: Callable) -> Callable:
    """fn with a code object of its own.

    torch.compile keeps its compiled variants on the code object, with one recompile limit
    (8) for all of them, whichever torch.compile wrapper made them. The static decode
    variants and the dynamic prefill ones of one function would share that limit; the bench,
    which builds three models in one process, hit it. A copy keeps the two apart.
    """
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    copy.__qualname__ = f"{fn.__qualname__}_dynamic"
    return copy


def compiled_ops(dynamic: bool = False) -> PointwiseOps:
    """PointwiseOps fused by torch.compile; each function compiles on its first call.

    dynamic=False (decode): shapes are fixed per model and bucket, so no guards on sizes; the
    caller must warm up before CUDA-graph capture. dynamic=True (prefill): the token count
    varies with every prompt's last chunk, so one compile serves every count.
    """
    def compile_one(fn: Callable) -> Callable:
        if dynamic:
            if fn not in _DYNAMIC_COPIES:
                _DYNAMIC_COPIES[fn] = _own_code(fn)
            fn = _DYNAMIC_COPIES[fn]
        return _eager_unless_compiled(
            partial(torch.compile, fn, dynamic=dynamic, fullgraph=True), fn)

    return PointwiseOps(
        rms_norm=compile_one(rms_norm),
        add_rms_norm=compile_one(add_rms_norm),
        qk_norm_rope=compile_one(qk_norm_rope),
        masked_softmax=compile_one(masked_softmax),
        silu_mul=compile_one(silu_mul),
        gelu_mul=compile_one(gelu_mul),
        silu_mul_scale=compile_one(silu_mul_scale),
        sum_rows=compile_one(sum_rows),
        moe_block=compile_one(grouped_block) if dynamic else None,  # only prefill groups rows
        is_compiled=True,
    )
