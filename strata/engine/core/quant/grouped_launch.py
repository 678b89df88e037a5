"""The host side both grouped expert GEMMs share (expert_gemm.py: blocks decoded in the K
loop; expert_mmq.py: int8 products): their autotune candidates, the rows-per-expert bucket
the tuner keys on, and the grid of (output tiles, row tiles) whose row tiles never cross an
expert. No kernels here: importing it decorates nothing."""

from __future__ import annotations

from strata.engine.core.kernels import launch

MAX_ROWS_HINT = 256  # rows-per-expert buckets past this tune alike


def candidates(configs: tuple, interpreter_configs: tuple) -> tuple:
    """launch.tuned's candidates from (BLOCK_ROWS, BLOCK_COLS, warps, BLOCK_M, STAGES) rows;
    the interpreter's own under it."""
    if launch.is_interpreting():
        configs = interpreter_configs
    return tuple((n, k, w, {"BLOCK_M": m, "STAGES": s}) for n, k, w, m, s in configs)


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def rows_hint(num_rows: int, num_experts: int) -> int:
    """Rows per expert, to a power of two: the autotuner's bucket for the chunk length."""
    return min(MAX_ROWS_HINT, _next_power_of_2(max(1, -(-num_rows // num_experts))))


def grid(num_rows: int, num_experts: int, num_outputs: int):
    """The launch grid for a tile's meta: at most ceil(R / BLOCK_M) + E row tiles, since each
    expert wastes less than one."""
    def of(meta):
        return (-(-num_outputs // meta["BLOCK_ROWS"]),
                -(-num_rows // meta["BLOCK_M"]) + num_experts)
    return of
