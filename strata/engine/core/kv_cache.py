"""Per-layer key/value buffers that the attention layers write into and read from.

A plain container: the engine tracks how many tokens of it are valid. The buffers come from an
`allocate` hook when one is given, so the KV memory arena can hand out views over its own
address range instead of torch allocations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# allocate(shape, dtype) -> a tensor of exactly that shape and dtype, on the cache's device.
Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


class KVCache:
    """K and V buffers for every layer: `k[layer]`, `v[layer]`, each [max_tokens, kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        allocate: Allocate | None = None,
    ):
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_tokens", max_tokens),
        ):
            if value <= 0:
                raise ValueError(f"KVCache {name} must be positive, not {value}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_tokens = max_tokens
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (max_tokens, num_kv_heads, head_dim)
        if allocate is None:
            allocate = self._torch_allocate
        self.k = [self._checked(allocate(shape, dtype), shape) for _ in range(num_layers)]
        self.v = [self._checked(allocate(shape, dtype), shape) for _ in range(num_layers)]

    def _torch_allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Zeros rather than empty: a stale NaN can never leak in, and the cost is one memset.
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _checked(self, buffer: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(buffer.shape) != shape or buffer.dtype != self.dtype:
            raise ValueError(
                f"KVCache allocate hook returned {tuple(buffer.shape)} {buffer.dtype}, "
                f"expected {shape} {self.dtype}: the hook must honour the shape and dtype asked"
            )
        same_index = self.device.index is None or buffer.device.index == self.device.index
        if buffer.device.type != self.device.type or not same_index:
            raise ValueError(
                f"KVCache allocate hook returned a buffer on {buffer.device}, expected {self.device}"
            )
        return buffer

    @classmethod
    def for_config(
        cls,
        config,
        max_tokens: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        allocate: Allocate | None = None,
    ) -> KVCache:
        """A cache shaped for `config` (a ModelConfig) holding up to `max_tokens` positions."""
        return cls(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            max_tokens,
            dtype,
            device,
            allocate,
        )

    def regions(self) -> list[torch.Tensor]:
        """Every buffer in snapshot region order: k0, v0, k1, v1, ..."""
        return [t for layer in range(self.num_layers) for t in (self.k[layer], self.v[layer])]

    def load_rows(self, state: list[torch.Tensor], num_tokens: int) -> None:
        """Write rows 0..num_tokens-1 of every region from `state` (region order, each
        [num_tokens, kv_heads, head_dim]). Copies are non_blocking: the caller synchronizes
        before `state` may be freed."""
        for dst, src in zip(self.regions(), state, strict=True):
            dst[:num_tokens].copy_(src, non_blocking=True)

    @property
    def bytes_per_token(self) -> int:
        """Bytes that one token position takes across all layers, K and V together."""
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes

    @property
    def nbytes(self) -> int:
        """Bytes held by all K and V buffers at full capacity."""
        return sum(t.nbytes for t in self.k) + sum(t.nbytes for t in self.v)


def check_positions(positions: Sequence[int], kvs: Sequence[KVCache]) -> None:
    """A decode step writes each sequence's K/V at its position: every one must fit its
    cache (a batched step checks here once, before any kernel writes)."""
    for position, kv in zip(positions, kvs, strict=True):
        if not 0 <= position < kv.max_tokens:
            raise ValueError(f"position {position} does not fit the KV cache of "
                             f"{kv.max_tokens} tokens")
