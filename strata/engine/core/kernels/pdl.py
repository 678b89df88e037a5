"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

A decode step of a MoE model is hundreds of short kernels inside one CUDA graph. Each kernel
spends about as long ramping up (launch, first loads in flight) and draining as its bytes
take, while the previous one drains (docs/benchmarks.md, "Figures behind the fast path").
With PDL (Hopper and later) the next kernel launches while the previous one is still running,
reads what cannot have changed (its weights), and waits at `wait()` for the previous kernel's
writes.

The contract every kernel taking USE_PDL follows, so that waits chain (a kernel completes only
after its own wait, hence after all kernels before it):

- before `wait()`: only reads of data no kernel of this step writes (weights, norms) or that
  kernels two or more launches back wrote (see below); no writes;
- `wait()`, then `launch_dependents()`: the next kernel starts only once every program here has
  passed its wait, so in its pre-wait part everything up to this kernel's predecessor is done.

Kernels not launched with PDL (cuBLAS, Inductor, torch) serialize as usual on both sides.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional
    triton = None


def is_supported(device: torch.device) -> bool:
    """PDL can run: a CUDA device of compute capability >= 9.0, Triton with GDC, and not
    turned off by STRATA_PDL=0 (a switch for measuring what it gives)."""
    if triton is None or device.type != "cuda" or os.environ.get("STRATA_PDL") == "0":
        return False
    if not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(use_pdl: bool) -> dict:
    """A kernel's USE_PDL and, when on, Triton's launch_pdl (only then: the CPU interpreter
    takes no launch_pdl)."""
    return {"USE_PDL": True, "launch_pdl": True} if use_pdl else {"USE_PDL": False}


if triton is not None:

    @triton.jit
    def wait(USE_PDL: tl.constexpr):
        """Wait for the previous kernel's writes, then let the next kernel launch."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
