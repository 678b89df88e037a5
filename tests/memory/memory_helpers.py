"""Helpers for the CPU memory tests (a uniquely named module: conftest is not importable)."""

import torch

MIB = 1 << 20


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    """Seeded random uint8 content, so a zero page or a stale chunk never passes by luck."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
