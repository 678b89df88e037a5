"""What an arena backend hands out and raises: a reserved range, and running out of memory.

Apart from backend.py so that the implementations (cuda_vmm.py, cpu_mmap.py) need not import
the module that picks between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from strata.units import MIB


class BackendOutOfMemory(Exception):
    """The backend could not get physical memory for a chunk (another process holds it)."""

    def __init__(self, requested_bytes: int, detail: str):
        super().__init__(f"out of memory mapping {requested_bytes / MIB:.0f} MiB: {detail}")
        self.requested_bytes = requested_bytes
        self.detail = detail


@dataclass
class Reservation:
    """A reserved address range and a uint8 tensor [size_bytes] viewing all of it, zero-copy."""

    base_address: int
    size_bytes: int
    base_tensor: torch.Tensor
    handle: Any = None  # backend-private (the os_pages range on CPU)
