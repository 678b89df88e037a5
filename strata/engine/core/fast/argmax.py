"""The index of a row's largest value in one Triton launch: the greedy token of a decode step.

torch.argmax over one row of a 128k-152k vocabulary reduces it in one block, a launch as
long as several of the step's norms (docs/benchmarks.md, run 30). Here the row is split
over programs of BLOCK values; each stores its largest value and that value's first
index, and whichever program finishes last (a completion counter, as
moe_triton._router_kernel selects experts) reduces those partials and stores the index.
Ties go to the lowest index and NaN counts as the largest value, as torch.argmax gives them
(among NaN and +inf together the lowest index of either wins: a row that holds both is
already garbage).
"""

from __future__ import annotations

import torch

from strata.engine.core.kernels import launch, pdl

try:
    import triton
    import triton.language as tl

    from strata.engine.core.kernels.pdl import wait as pdl_wait
except ImportError:  # optional: torch.argmax serves without it
    triton = None

BLOCK = 4096  # values a program; a 152k vocabulary is 38 programs
MAX_PROGRAMS = 1024  # the last program holds every partial: rows up to 4M values


if triton is not None:

    @triton.jit
    def _argmax_kernel(x_ptr, num_values, part_max_ptr, part_idx_ptr, counter_ptr, out_ptr,
                       BLOCK: tl.constexpr, PARTS: tl.constexpr, USE_PDL: tl.constexpr):
        pdl_wait(USE_PDL)  # x comes from the kernel just before
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs, mask=offs < num_values, other=float("-inf")).to(tl.float32)
        v = tl.where(v != v, float("inf"), v)  # NaN wins, as in torch.argmax
        best = tl.max(v, axis=0)
        first = tl.min(tl.where(v == best, offs, num_values), axis=0)
        tl.store(part_max_ptr + pid, best)
        tl.store(part_idx_ptr + pid, first)
        tl.debug_barrier()  # every thread's stores issued before the release below
        # The last program to finish reduces: acq_rel orders every program's partial before
        # its count, and the counter goes back to 0 for the next launch (or graph replay).
        finished = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
        if finished == tl.num_programs(0) - 1:
            parts = tl.arange(0, PARTS)
            ok = parts < tl.num_programs(0)
            m = tl.load(part_max_ptr + parts, mask=ok, other=float("-inf"), volatile=True)
            i = tl.load(part_idx_ptr + parts, mask=ok, other=num_values, volatile=True)
            top = tl.max(m, axis=0)
            tl.store(out_ptr, tl.min(tl.where(m == top, i, num_values), axis=0).to(tl.int64))
            tl.atomic_xchg(counter_ptr, 0)


def is_usable(device: torch.device) -> bool:
    """The kernel can run on device: Triton on CUDA, or its CPU interpreter."""
    return triton is not None and launch.is_usable(device)


def new_counter(device: torch.device) -> torch.Tensor:
    """A zeroed completion counter for `first_max`; each launch leaves it at 0 again."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def first_max(x: torch.Tensor, counter: torch.Tensor, use_pdl: bool = False) -> torch.Tensor:
    """torch.argmax(x, dim=-1, keepdim=True) for one row x [V] (any float dtype): [1] int64.
    counter: new_counter's, used by one launch at a time (one stream). use_pdl: launched as
    a PDL secondary (pdl.py)."""
    if x.dim() != 1 or x.numel() == 0 or not x.is_floating_point():
        raise ValueError(f"first_max takes one non-empty row of floats, got {tuple(x.shape)} "
                         f"{x.dtype}")
    num_values = x.numel()
    programs = triton.cdiv(num_values, BLOCK)
    if programs > MAX_PROGRAMS:
        raise ValueError(f"first_max takes up to {MAX_PROGRAMS * BLOCK} values, got "
                         f"{num_values}")
    if counter.shape != (1,) or counter.dtype != torch.int32 or counter.device != x.device:
        raise ValueError(f"first_max's counter is new_counter's int32 [1] on {x.device}, got "
                         f"{counter.dtype} {tuple(counter.shape)} on {counter.device}")
    part_max = torch.empty(programs, dtype=torch.float32, device=x.device)
    part_idx = torch.empty(programs, dtype=torch.int32, device=x.device)
    out = torch.empty(1, dtype=torch.int64, device=x.device)
    _argmax_kernel[(programs,)](x.contiguous(), num_values, part_max, part_idx, counter, out,
                                BLOCK=BLOCK, PARTS=triton.next_power_of_2(programs),
                                **pdl.launch_options(use_pdl))
    return out
