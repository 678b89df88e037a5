"""The lookup table the dequantizers read: the I-quants' grids and sign patterns, as torch.

Every non-linear GGML type looks its values up in a fixed table (ggml-common.h): IQ4's 16
levels, the 128 sign patterns of IQ2/IQ3 (`ksigns_iq2xs`), and the 8- or 4-value grids of
IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S and IQ1_S/IQ1_M. They are concatenated into one int8
tensor per device (34 KB: it stays in L1/L2) at the offsets dequant_tile.py names. The values
are taken from gguf-py's own tables (`gguf.quants.<TYPE>.grid`), the oracle of the tests, so
no table is copied by hand.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import quants

from strata.engine.core.quant import dequant_tile as dt

# IQ4_NL / IQ4_XS's non-linear levels (ggml's kvalues_iq4nl).
IQ4_GRID = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

_tables: dict[torch.device, torch.Tensor] = {}


def _grid(cls) -> np.ndarray:
    cls.init_grid()
    return np.asarray(cls.grid, dtype=np.float32).reshape(-1)


def table_values() -> np.ndarray:
    """The whole table as int8 (ksigns bytes wrap: readers mask them with 255)."""
    parts = [
        (dt.LUT_IQ4, np.array(IQ4_GRID, dtype=np.float32)),
        (dt.LUT_KSIGNS, np.frombuffer(quants.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.float32)),
        (dt.LUT_IQ2_XXS, _grid(quants.IQ2_XXS)),
        (dt.LUT_IQ2_XS, _grid(quants.IQ2_XS)),
        (dt.LUT_IQ2_S, _grid(quants.IQ2_S)),
        (dt.LUT_IQ3_XXS, _grid(quants.IQ3_XXS)),
        (dt.LUT_IQ3_S, _grid(quants.IQ3_S)),
        (dt.LUT_IQ1_S, _grid(quants.IQ1_S)),
    ]
    out = np.zeros(dt.LUT_SIZE, dtype=np.int16)
    ends = [offset for offset, _ in parts[1:]] + [dt.LUT_SIZE]
    for (offset, values), end in zip(parts, ends):
        if offset + values.size != end:  # the kernels index by these offsets
            raise RuntimeError(f"dequant_tile's table offset {offset} does not fit gguf's grids")
        out[offset:end] = values.astype(np.int16)
    return out.astype(np.uint8).view(np.int8)


def lookup_table(device: torch.device) -> torch.Tensor:
    """The table as int8 on `device` (one per device, made once)."""
    device = torch.device(device)
    table = _tables.get(device)
    if table is None:
        table = _tables[device] = torch.from_numpy(table_values().copy()).to(device)
    return table
