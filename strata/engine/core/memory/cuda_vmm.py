"""Arena backend on CUDA virtual memory management (cuda.bindings.driver).

The address range is reserved once (cuMemAddressReserve); physical memory is created and mapped
chunk by chunk (cuMemCreate + cuMemMap), made accessible once per mapped run (cuMemSetAccess),
and given back with cuMemUnmap + cuMemRelease. Torch and the driver API share the device's
primary context, so torch kernels and graphs see the mapped memory at a fixed address.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from cuda.bindings import driver as cu

from strata.engine.core.memory.reservation import BackendOutOfMemory, Reservation

log = logging.getLogger(__name__)

_SUCCESS = cu.CUresult.CUDA_SUCCESS
_OOM = cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""

    def __init__(self, call: str, err: Any):
        super().__init__(f"{call} failed: {error_text(err)}")
        self.call = call
        self.err = err


def error_text(err: Any) -> str:
    """'CUDA_ERROR_X: description' for a CUresult, never raising."""
    try:
        name = cu.cuGetErrorName(err)[1].decode()
        text = cu.cuGetErrorString(err)[1].decode()
        return f"{name}: {text}"
    except Exception:  # noqa: BLE001 - a driver too broken to describe its own error
        return str(err)


def check(result: tuple, call: str) -> Any:
    """Unpack a cuda.bindings result tuple: raise CudaError unless its CUresult is success."""
    err = result[0]
    if err != _SUCCESS:
        raise CudaError(call, err)
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def driver_device_count() -> int:
    """Number of CUDA devices the driver sees; raises when there is no driver (cuInit raises)."""
    check(cu.cuInit(0), "cuInit")
    return int(check(cu.cuDeviceGetCount(), "cuDeviceGetCount"))


_primary_contexts: dict[int, Any] = {}


def primary_context(device_index: int) -> Any:
    """The device's primary context, the one torch uses, retained once and made current."""
    context = _primary_contexts.get(device_index)
    if context is None:
        # torch first, so the driver API retains the very context torch runs its kernels in.
        torch.cuda.init()
        with torch.cuda.device(device_index):
            torch.cuda.synchronize()  # creates the primary context if torch has not yet
        check(cu.cuInit(0), "cuInit")
        cu_device = check(cu.cuDeviceGet(device_index), "cuDeviceGet")
        context = check(cu.cuDevicePrimaryCtxRetain(cu_device), "cuDevicePrimaryCtxRetain")
        _primary_contexts[device_index] = context
    make_current(context)
    return context


def reset_primary_context(device_index: int) -> None:
    """Destroy the device's primary context now: its VRAM returns at once (an 8B model's
    ~900 MiB of context and allocator memory in ~0.1 s on an H200, where a plain process exit
    first tears down and unpins the host copies: 1.5 s). Only for a process about to exit:
    every tensor, graph and handle of torch on that device is dead afterwards."""
    cu_device = check(cu.cuDeviceGet(device_index), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxReset(cu_device), "cuDevicePrimaryCtxReset")
    _primary_contexts.pop(device_index, None)


def make_current(context: Any) -> None:
    """Bind context to the calling thread unless it already is (driver calls need one)."""
    current = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if current is None or int(current) != int(context):
        check(cu.cuCtxSetCurrent(context), "cuCtxSetCurrent")


class _DeviceRange:
    """Exposes [address, address+size) to torch.as_tensor through __cuda_array_interface__."""

    def __init__(self, address: int, size_bytes: int):
        # Version 2 has no stream key, so torch does not synchronize on import.
        self.__cuda_array_interface__ = {
            "shape": (size_bytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 2,
        }


class CudaVmmBackend:
    """Reserve/map/unmap device memory of one GPU in the primary context that torch uses."""

    kind = "cuda"

    def __init__(self, device_index: int = 0):
        self.device = torch.device("cuda", device_index)
        self._context = primary_context(device_index)
        self.make_current()

        self._prop = cu.CUmemAllocationProp()
        self._prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = device_index
        self._access = cu.CUmemAccessDesc()
        self._access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = device_index
        self._access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.granularity_bytes = int(
            check(
                cu.cuMemGetAllocationGranularity(
                    self._prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
                ),
                "cuMemGetAllocationGranularity",
            )
        )

    def make_current(self) -> None:
        """Bind the primary context to this thread if another (or none) is current."""
        make_current(self._context)

    def reserve(self, size_bytes: int) -> Reservation:
        """Reserve the address range and build the uint8 torch view over all of it."""
        self.make_current()
        ptr = check(
            cu.cuMemAddressReserve(size_bytes, 0, cu.CUdeviceptr(0), 0), "cuMemAddressReserve"
        )
        reservation = Reservation(int(ptr), size_bytes, base_tensor=None)  # type: ignore[arg-type]
        try:
            reservation.base_tensor = self._make_base_tensor(reservation)
        except BaseException:
            check(cu.cuMemAddressFree(ptr, size_bytes), "cuMemAddressFree")
            raise
        return reservation

    def _make_base_tensor(self, reservation: Reservation) -> torch.Tensor:
        # torch asks the driver which device owns the pointer, and an unmapped address has
        # none, so one granule is mapped at the base while the view is made.
        granule = self.granularity_bytes
        handle = self.map_chunk(reservation, 0, granule)
        try:
            self.set_access(reservation, 0, granule)
            base = torch.as_tensor(
                _DeviceRange(reservation.base_address, reservation.size_bytes), device=self.device
            )
        finally:
            self.unmap_chunk(reservation, 0, granule, handle)
        if base.data_ptr() != reservation.base_address or base.dtype != torch.uint8:
            raise RuntimeError(
                "torch.as_tensor copied the VMM range instead of viewing it; this torch build "
                "does not support zero-copy __cuda_array_interface__ views"
            )
        return base

    def map_chunk(self, reservation: Reservation, offset_bytes: int, size_bytes: int) -> Any:
        """cuMemCreate + cuMemMap one chunk; BackendOutOfMemory when the GPU has no room."""
        self.make_current()
        err, handle = cu.cuMemCreate(size_bytes, self._prop, 0)
        if err == _OOM:
            raise BackendOutOfMemory(size_bytes, f"cuMemCreate: {error_text(err)}")
        if err != _SUCCESS:
            raise CudaError("cuMemCreate", err)
        address = cu.CUdeviceptr(reservation.base_address + offset_bytes)
        (err,) = cu.cuMemMap(address, size_bytes, 0, handle, 0)
        if err != _SUCCESS:
            check(cu.cuMemRelease(handle), "cuMemRelease")
            if err == _OOM:
                raise BackendOutOfMemory(size_bytes, f"cuMemMap: {error_text(err)}")
            raise CudaError("cuMemMap", err)
        return handle

    def set_access(self, reservation: Reservation, offset_bytes: int, size_bytes: int) -> None:
        """Read/write access for this device over a run of freshly mapped chunks."""
        address = cu.CUdeviceptr(reservation.base_address + offset_bytes)
        check(cu.cuMemSetAccess(address, size_bytes, [self._access], 1), "cuMemSetAccess")

    def unmap_chunk(
        self, reservation: Reservation, offset_bytes: int, size_bytes: int, handle: Any
    ) -> None:
        """cuMemUnmap + cuMemRelease: the physical memory is free when this returns."""
        self.make_current()
        address = cu.CUdeviceptr(reservation.base_address + offset_bytes)
        check(cu.cuMemUnmap(address, size_bytes), "cuMemUnmap")
        check(cu.cuMemRelease(handle), "cuMemRelease")

    def synchronize(self) -> None:
        """cuCtxSynchronize: every stream of the context, torch's included, is idle after it."""
        self.make_current()
        check(cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def free(self, reservation: Reservation) -> None:
        """Give back the address range (all chunks must be unmapped)."""
        self.make_current()
        address = cu.CUdeviceptr(reservation.base_address)
        check(cu.cuMemAddressFree(address, reservation.size_bytes), "cuMemAddressFree")

    def device_memory_bytes(self) -> tuple[int, int]:
        """(free, total) device memory as the driver sees it."""
        self.make_current()
        free_bytes, total_bytes = check(cu.cuMemGetInfo(), "cuMemGetInfo")
        return int(free_bytes), int(total_bytes)
