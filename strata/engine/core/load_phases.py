"""Where a load's seconds go: named phases, timed and reported with the load (issue 18 item 6).

Engine.load opens a LoadPhases and makes it the active one; the parts of the load that live
elsewhere (residency.py: weights mapped and filled, the model built, quantized kernels warmed
up; fast/tuning.py: compile, tune, capture) mark their phases through `phase(name)`, which
does nothing outside a load. Phases nest and count exclusively: a phase opened inside
another takes its seconds out of the outer one, so the engine can time a whole step (the
weights) while the step's own code names the parts it knows (the model built, kernels warmed
up). A phase that ran on a GPU synchronizes at its end, so queued work is counted where it
was queued, not in the phase that happens to wait for it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

# The phases in load order; the breakdown lists them in this order, each always present
# (0.0 where a load skipped it: a stored tuning result, a CPU load).
PHASE_NAMES = (
    "cuda_init",       # the device's context and the arena backend
    "read_file",       # the model's config and tensor index (GGUF header, safetensors index)
    "map_weights",     # arenas mapped and filled from the file
    "build_model",     # modules built over the arena views
    "warm_up",         # quantized kernels compiled and autotuned, scratch sized
    "decoder_setup",   # the fast decoder's buffers and sampler (CUDA)
    "check_kernels",   # the Triton decode kernels checked against torch
    "compile",         # torch.compile of the prefill's element-wise groups
    "tune",            # prefill op choice and prefill-graph timing (0 when stored)
    "capture_graphs",  # graphs captured at load (the prefill-graph probe)
    "kv_and_slots",    # the KV arena, slots, the batch scheduler
)

_active: LoadPhases | None = None


class LoadPhases:
    """Seconds per named phase of one load."""

    def __init__(self, device=None):
        """device: a torch.device; on CUDA each phase synchronizes it at its end."""
        self.device = device
        self.seconds: dict[str, float] = dict.fromkeys(PHASE_NAMES, 0.0)
        self._open: list[list] = []  # [name, perf_counter when its clock last started]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (added to what that phase already has)."""
        if name not in self.seconds:
            raise ValueError(f"unknown load phase {name!r}; known: {', '.join(PHASE_NAMES)}")
        started_s = time.perf_counter()
        if self._open:  # the outer phase's clock stops while this one runs
            outer = self._open[-1]
            self.seconds[outer[0]] += started_s - outer[1]
        entry = [name, started_s]
        self._open.append(entry)
        try:
            yield
        finally:
            self._synchronize()
            ended_s = time.perf_counter()
            self._open.pop()
            self.seconds[name] += ended_s - entry[1]
            if self._open:
                self._open[-1][1] = ended_s

    def _synchronize(self) -> None:
        device = self.device
        if device is None or getattr(device, "type", None) != "cuda":
            return
        import torch

        torch.cuda.synchronize(device)  # in cuda_init: creates the context, if nothing had

    def breakdown_s(self) -> dict[str, float]:
        """{"<phase>_s": seconds}, every phase in load order, rounded to the millisecond."""
        return {f"{name}_s": round(self.seconds[name], 3) for name in PHASE_NAMES}

    def summary(self) -> str:
        """One line for the load's log: the phases that took any time, in order."""
        parts = [f"{name} {seconds:.2f} s" for name, seconds in self.seconds.items()
                 if seconds >= 0.005]
        return ", ".join(parts) or "no phase over 5 ms"


@contextlib.contextmanager
def recording(phases: LoadPhases) -> Iterator[LoadPhases]:
    """Make `phases` the one `phase()` records into, for the block (one load)."""
    global _active
    previous, _active = _active, phases
    try:
        yield phases
    finally:
        _active = previous


def phase(name: str) -> contextlib.AbstractContextManager:
    """The active load's phase `name`; a no-op outside a load (a bench or test calling a part
    of the load on its own)."""
    if _active is None:
        return contextlib.nullcontext()
    return _active.phase(name)

