"""The cache protocol for a slot's KV (STYLE §5): state, metadata, from_state, nbytes.

A slot's state is only its used tokens: per layer k and v [num_tokens, kv_heads, head_dim].
`SlotCache` is the live cache (device buffers sized for the whole context); `KVSnapshot` is
its host copy, which the store keeps in RAM or writes to a file. Both speak the same protocol,
so `SlotCache.from_state(snapshot.state, snapshot.metadata, kv)` restores a slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from strata.engine.core.kv_cache import KVCache
from strata.engine.core.memory.host_copy import side_stream
from strata.engine.core.snapshots.errors import SnapshotInvalid
from strata.engine.core.snapshots.host_pool import HostPool, align_up


@dataclass(frozen=True)
class KVLayout:
    """What a snapshot's bytes mean: how many layers and heads, how wide, which dtype."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "bfloat16"

    @classmethod
    def of(cls, kv: KVCache) -> KVLayout:
        """The layout of a live KV cache."""
        return cls(kv.num_layers, kv.num_kv_heads, kv.head_dim, dtype_name(kv.dtype))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        return cls(int(d["num_layers"]), int(d["num_kv_heads"]), int(d["head_dim"]), str(d["dtype"]))

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise SnapshotInvalid("other_layout", f"snapshot dtype {self.dtype!r} is not a torch dtype")
        return dtype

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def region_bytes_per_token(self) -> int:
        """Bytes of one token in one region (one layer's k or v)."""
        return self.num_kv_heads * self.head_dim * self.element_bytes

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token across all layers, k and v together."""
        return 2 * self.num_layers * self.region_bytes_per_token


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def region_names(num_layers: int) -> list[str]:
    """Names of the state tensors in order: k0, v0, k1, v1, ..."""
    return [f"{kind}{layer}" for layer in range(num_layers) for kind in ("k", "v")]


def check_metadata(metadata: dict[str, Any], fingerprint: str, layout: KVLayout) -> None:
    """Raise SnapshotInvalid when a state belongs to another model or another layout."""
    if metadata.get("fingerprint") != fingerprint:
        raise SnapshotInvalid(
            "other_model", "the snapshot was made by another model (fingerprint differs)"
        )
    theirs = metadata.get("layout")
    if theirs != layout.as_dict():
        raise SnapshotInvalid(
            "other_layout", f"the snapshot layout {theirs} differs from this model's {layout.as_dict()}"
        )


class SlotCache:
    """One slot's live KV cache and the token ids whose K/V it holds, in order."""

    def __init__(self, kv: KVCache, fingerprint: str, tokens: list[int] | None = None):
        self.kv = kv
        self.fingerprint = fingerprint
        self.tokens: list[int] = list(tokens or [])
        self.last_used_s = time.monotonic()

    @property
    def layout(self) -> KVLayout:
        return KVLayout.of(self.kv)

    @property
    def state(self) -> list[torch.Tensor]:
        """Views of the used rows, in region order (k0, v0, k1, ...), each [n, kv_heads, head_dim]."""
        n = len(self.tokens)
        return [t[:n] for t in self.kv.regions()]

    @property
    def metadata(self) -> dict[str, Any]:
        return {
            "token_ids": tuple(self.tokens),
            "fingerprint": self.fingerprint,
            "layout": self.layout.as_dict(),
        }

    @property
    def nbytes(self) -> int:
        """Bytes of KV storage this slot holds (its buffers, at full capacity)."""
        return self.kv.nbytes

    @classmethod
    def from_state(
        cls, state: list[torch.Tensor], metadata: dict[str, Any], kv: KVCache
    ) -> SlotCache:
        """Write `state` into the empty cache `kv` and return the slot cache over it.

        Raises SnapshotInvalid when the state does not fit `kv` (other layout, too long).
        """
        layout = KVLayout.of(kv)
        if metadata.get("layout") != layout.as_dict():
            raise SnapshotInvalid(
                "other_layout",
                f"the snapshot layout {metadata.get('layout')} differs from the cache's {layout.as_dict()}",
            )
        tokens = list(metadata["token_ids"])
        if len(tokens) > kv.max_tokens:
            raise SnapshotInvalid(
                "other_layout",
                f"the snapshot holds {len(tokens)} tokens but the context is {kv.max_tokens}",
            )
        expected = (len(tokens), kv.num_kv_heads, kv.head_dim)
        if len(state) != 2 * kv.num_layers or any(tuple(t.shape) != expected for t in state):
            raise SnapshotInvalid("other_layout", f"the snapshot tensors are not {expected} per region")
        try:
            with torch.inference_mode():
                kv.load_rows(state, len(tokens))
        finally:
            # One sync for all regions; also on failure, so `state` is never freed mid-copy.
            if kv.device.type == "cuda":
                torch.cuda.synchronize(kv.device)
        return cls(kv, str(metadata["fingerprint"]), tokens)


def copy_to_host(
    regions: list[torch.Tensor],
    pool: HostPool | None,
    on_region_copied: Callable[[int], None] | None = None,
) -> list[torch.Tensor]:
    """Host copies of `regions`, laid out in one pool block when the pool has room.

    On a GPU every region is copied non_blocking on the side stream, so the copies queue back
    to back at PCIe speed. `on_region_copied(i)` runs once region i's bytes are on the host
    while the later copies are still running (an offload gives region i's pages back there).
    """
    offsets, total_bytes = [], 0
    for t in regions:
        offsets.append(total_bytes)
        total_bytes += align_up(t.nbytes)
    device = regions[0].device if regions else torch.device("cpu")
    block = pool.alloc(total_bytes, device) if pool is not None and total_bytes else None
    if block is None:
        # Ordinary memory: no pool, or it is full (its capacity is the snapshot RAM budget).
        block = torch.empty(total_bytes, dtype=torch.uint8)
    dst = [
        block[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        for offset, t in zip(offsets, regions, strict=True)
    ]
    if device.type != "cuda":
        for i, (d, s) in enumerate(zip(dst, regions, strict=True)):
            d.copy_(s)
            if on_region_copied is not None:
                on_region_copied(i)
        return dst
    stream = side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the KV writes queued before us
    try:
        copied = []
        with torch.cuda.stream(stream):
            for d, s in zip(dst, regions, strict=True):
                d.copy_(s, non_blocking=True)
                copied.append(stream.record_event() if on_region_copied is not None else None)
        if on_region_copied is not None:
            for i, event in enumerate(copied):
                event.synchronize()
                on_region_copied(i)
    finally:
        # Before the block can be dropped (also on failure) and before the caller frees the KV.
        stream.synchronize()
    return dst


@dataclass
class KVSnapshot:
    """A host copy of a slot's used KV: what the store keeps in RAM or writes to a file."""

    layout: KVLayout
    fingerprint: str
    token_ids: tuple[int, ...]
    regions: list[torch.Tensor]  # CPU, region order (k0, v0, k1, ...), each [n, kv_heads, head_dim]
    created_s: float = field(default_factory=time.time)
    expires_s: float | None = None  # wall-clock time after which it is stale; None: never

    @classmethod
    def capture(
        cls,
        cache: SlotCache,
        created_s: float | None = None,
        expires_s: float | None = None,
        pool: HostPool | None = None,
        on_region_copied: Callable[[int], None] | None = None,
    ) -> KVSnapshot:
        """Copy the used rows of a live slot to host memory.

        The regions go into one block of `pool` (the store's, pinned on a GPU), or into ordinary
        memory when there is no pool or it is full. on_region_copied: see copy_to_host.
        """
        # Everything but the copies first, while nothing waits on them: converting 32k token
        # ids after the last copy (from_state's checks) put 3 ms on an offload's critical path.
        layout, token_ids = cache.layout, tuple(cache.tokens)
        created_s = created_s or time.time()
        regions = copy_to_host(cache.state, pool, on_region_copied)
        return cls(layout=layout, fingerprint=cache.fingerprint, token_ids=token_ids,
                   regions=regions, created_s=created_s, expires_s=expires_s)

    @property
    def state(self) -> list[torch.Tensor]:
        return self.regions

    @property
    def metadata(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "fingerprint": self.fingerprint,
            "layout": self.layout.as_dict(),
            "created_s": self.created_s,
            "expires_s": self.expires_s,
        }

    @classmethod
    def from_state(cls, state: list[torch.Tensor], metadata: dict[str, Any]) -> KVSnapshot:
        return cls(
            layout=KVLayout.from_dict(metadata["layout"]),
            fingerprint=str(metadata["fingerprint"]),
            token_ids=tuple(map(int, metadata["token_ids"])),
            regions=list(state),
            created_s=float(metadata.get("created_s") or time.time()),
            expires_s=metadata.get("expires_s"),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V payload (the token ids are not counted)."""
        return sum(t.nbytes for t in self.regions)

    def is_expired(self, now_s: float) -> bool:
        return self.expires_s is not None and now_s > self.expires_s
