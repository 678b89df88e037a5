"""Launching Triton kernels: autotuned on CUDA, the first candidate under the CPU interpreter.

Candidates are (BLOCK_ROWS, BLOCK_COLS, num_warps, UNROLL or None or a dict of the kernel's
other tuned constexprs) tuples. On CUDA a kernel is
autotuned once per matrix shape; under TRITON_INTERPRET=1 (the CPU tests) the first candidate
runs: the same kernels, through the interpreter (GEMV-like kernels pass interpreter_rows'
candidates: more rows a program).
"""

from __future__ import annotations

import os

import torch

from strata.engine.core.kernels import pdl

try:
    import triton
except ImportError:  # Triton is optional: the torch paths need only torch.
    triton = None


# Rows a program of a GEMV-like kernel (rows independent of each other) under the CPU
# interpreter, which pays per program and per op, not per value: one row a program made
# GPT-OSS's tiny decode test run 256 interpreted programs a MoE call (interpreter_rows).
INTERPRETER_ROWS = 64


def interpreter_rows(candidates: tuple) -> tuple:
    """candidates with a first one of at least INTERPRETER_ROWS rows, for `launch` to run
    under the interpreter (CUDA autotunes over the kernel's own `tuned` candidates)."""
    rows, *rest = candidates[0]
    return ((max(rows, INTERPRETER_ROWS), *rest), *candidates[1:])


def is_interpreting() -> bool:
    """Triton runs through its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def is_usable(device: torch.device) -> bool:
    """Triton imported and able to run here (a CUDA device, or the CPU interpreter)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return is_interpreting()


def slot_table_arg(table: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """The slot table to pass an expert kernel, or, without one (HAS_TABLE off: never read),
    a stand-in of the table's dtype (int32) over ids' memory. Triton's autotuner keys its
    pick by every tensor argument's dtype: with ids (int64) standing in, the stacked kernels
    were tuned apart from the slot-table ones and could pick other tiles, so a partial cache
    summed in another order than all-resident and a near tie in bf16 flipped (the live
    shrink's tokens parted from the unshrunk run's, in some runs only: both picks time).
    A table is checked: the kernels index it as a contiguous int32 [E] vector."""
    if table is not None:
        if table.dim() != 1 or table.dtype != torch.int32 or not table.is_contiguous():
            raise ValueError(f"the slot table must be a contiguous int32 [E] tensor, got "
                             f"{table.dtype} {tuple(table.shape)}")
        return table
    ids = ids.contiguous()
    return ids if ids.dtype == torch.int32 else ids.view(torch.int32)


def _block_kwargs(rows: int, cols: int, unroll: bool | dict | None) -> dict:
    # unroll None: the kernel has no UNROLL parameter (decode_dense.py's); a dict: other
    # constexprs the kernel is tuned over (quant/kernels.py's pipeline STAGES).
    if isinstance(unroll, dict):
        return {"BLOCK_ROWS": rows, "BLOCK_COLS": cols, **unroll}
    unrolled = {} if unroll is None else {"UNROLL": unroll}
    return {"BLOCK_ROWS": rows, "BLOCK_COLS": cols, **unrolled}


def tuned(kernel, candidates, key: tuple[str, ...] = ("num_rows", "num_cols")):
    """The kernel autotuned over candidates (BLOCK_ROWS, BLOCK_COLS, num_warps, UNROLL or None)
    on CUDA, keyed by the arguments named in key (matrix shape); as is when interpreting."""
    if is_interpreting():
        return kernel
    configs = [triton.Config(_block_kwargs(r, c, u), num_warps=w) for r, c, w, u in candidates]
    # Kernels only store (no accumulation into outputs), so timing reruns are harmless. The
    # slot-table variant shares the stacked one's pick (HAS_TABLE is not in the key, and
    # slot_table_arg gives both the same dtypes, which Triton adds to it): same block shapes,
    # same summation order, so a partial cache decodes bit for bit like all-resident.
    # cache_results: the picks go to Triton's disk cache, so a later load (a new engine
    # process) does not time every candidate again.
    return triton.autotune(configs=configs, key=list(key), cache_results=True)(kernel)


def launch(kernel, grid_for_rows, candidates, *args, use_pdl: bool = False, **kwargs) -> None:
    """Launch a `tuned` kernel with a grid over its rows; the first candidate when interpreting.
    use_pdl: pass the kernel's USE_PDL and launch it as a PDL secondary (pdl.py)."""
    launch_meta(kernel, lambda meta: grid_for_rows(meta["BLOCK_ROWS"]), candidates, *args,
                use_pdl=use_pdl, **kwargs)


def launch_meta(kernel, grid_for_meta, candidates, *args, use_pdl: bool = False,
                **kwargs) -> None:
    """`launch` for a grid that depends on more of the tuned constexprs than BLOCK_ROWS:
    grid_for_meta gets them all (BLOCK_ROWS, BLOCK_COLS and the candidates' dict)."""
    kwargs.update(pdl.launch_options(use_pdl))
    if is_interpreting():
        rows, cols, warps, unroll = candidates[0]
        meta = _block_kwargs(rows, cols, unroll)
        kernel[grid_for_meta(meta)](*args, **kwargs, **meta, num_warps=warps)
    else:
        kernel[grid_for_meta](*args, **kwargs)
