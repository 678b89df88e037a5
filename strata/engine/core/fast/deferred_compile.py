"""Work a load that has run before leaves until it is ready (issue 18 item 6): compiling the
prefill's element-wise groups, and re-checking the decode kernels whose verdicts it read.

torch.compile re-traces every compiled function in each new process, even with Inductor's
disk cache warm: seconds of a load that had nothing left to measure (its timings and kernel
verdicts stored). Such a load is ready without it. Until the compiled groups are ready the
prefill runs the very same functions eagerly (pointwise.py: the compiled ones are those,
fused), so results differ by float rounding at most, and prefill graphs capture the eager
ones too (dropped and captured again once compiled).

The steps run in the engine process's own thread, one at a time, when no command has arrived
for a moment (process.py): never while a request runs, never during a CUDA graph capture
(captures run in requests, on that same thread), never while the engine sleeps. Each step is
short (one group compiled by a 23-token prefill), so a request that arrives meanwhile waits
for one step at most, and then runs eagerly.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Callable

from strata.engine.core.fast.moe_prefill import grouped_block
from strata.engine.core.fast.pointwise import EAGER_OPS, PointwiseOps
from strata.engine.core.fast.prefill_runner import PrefillRunner
from strata.engine.core.fast.prefill_warm import warm_cudnn_plan, warm_prefill_pass
from strata.engine.core.models.layers import GeGLU

log = logging.getLogger(__name__)

Step = tuple[str, Callable[[], None]]

# The compiled groups, compiled one per step in this order (each step keeps the earlier ones).
GROUP_NAMES = ("rms_norm", "add_rms_norm", "qk_norm_rope", "silu_mul", "gelu_mul",
               "silu_mul_scale", "sum_rows", "masked_softmax", "moe_block")


class DeferredWork:
    """Named steps run one at a time (run_next) until none is left; where they stand."""

    def __init__(self) -> None:
        self._steps: deque[Step] = deque()
        self.state = "none"  # none | pending | done | failed
        self.seconds = 0.0  # spent in the steps run so far

    def add(self, steps: list[Step]) -> None:
        if steps:
            self._steps.extend(steps)
            self.state = "pending"

    @property
    def has_steps(self) -> bool:
        return bool(self._steps)

    def run_next(self) -> str:
        """Run the next step; its name. A step that raises ends the work (state "failed"):
        what already runs stays as it is, which is correct, only slower."""
        name, step = self._steps.popleft()
        started_s = time.perf_counter()
        try:
            step()
        except BaseException:
            self._steps.clear()
            self.state = "failed"
            raise
        finally:
            self.seconds += time.perf_counter() - started_s
        if not self._steps:
            self.state = "done"
            log.info("deferred load work done in %.2f s", self.seconds)
        return name


def interim_ops(compiled: PointwiseOps) -> PointwiseOps:
    """The eager counterpart of compiled: the same functions uncompiled, the MoE block too
    (so the same grouped path runs, not the sorted one)."""
    return dataclasses.replace(
        EAGER_OPS, moe_block=grouped_block if compiled.moe_block is not None else None)


def defer_prefill_compile(prefiller: PrefillRunner, compiled: PointwiseOps,
                          num_tokens: int = 23) -> list[Step]:
    """Make the prefiller run eagerly now, and return the steps that compile its groups and
    then hand it what the load chose (its `ops` now: compiled, or eager with the compiled
    MoE block) with compiled graph groups."""
    chosen = prefiller.ops
    interim = interim_ops(compiled)
    prefiller.set_ops(interim if _has_compiled(chosen) else chosen, interim)
    names = [name for name in GROUP_NAMES
             if getattr(compiled, name) is not None and _calls(prefiller.model, name)]
    steps: list[Step] = []
    for count in range(1, len(names) + 1):
        # Each pass keeps the groups compiled before it, so the last one runs every group
        # compiled, as requests will: a guard that only the full set trips compiles here.
        partial_ops = dataclasses.replace(
            interim, is_compiled=True, **{name: getattr(compiled, name) for name in names[:count]})
        steps.append((f"compile {names[count - 1]}",
                      functools.partial(warm_prefill_pass, prefiller, partial_ops, num_tokens)))
    steps.append(("cudnn plan", functools.partial(warm_cudnn_plan, prefiller)))

    def finish() -> None:
        prefiller.set_ops(chosen, compiled)
        log.info("prefill groups compiled after the load: %s from now on",
                 "compiled" if chosen.is_compiled else "eager (compiled MoE block)"
                 if chosen.moe_block is not None else "eager")

    steps.append(("use compiled groups", finish))
    return steps


def _calls(model, name: str) -> bool:
    """Whether a prefill of model calls group `name`: GeGLU's only where it has GeGLU (Gemma),
    so other models spend no pass on it."""
    return name != "gelu_mul" or any(isinstance(m, GeGLU) for m in model.modules())


def _has_compiled(ops: PointwiseOps) -> bool:
    return ops.is_compiled or ops.moe_block is not None
