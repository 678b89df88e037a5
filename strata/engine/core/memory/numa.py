"""NUMA: which node a GPU hangs off, binding a host range's pages to it, and where pages sit.

A GPU reads a pinned host copy over PCIe through its own CPU socket's root complex; pages on
the other socket cross the inter-socket link first, which costs most for the small reads a
decode step makes in place and for ~1 MiB promotion copies (issue 54: two H100 hosts, same
bulk copy rate, 15.2 against 9.6 GB/s for promotion copies). Linux only, through ctypes
syscalls (mbind(2), move_pages(2)): glibc does not export them and libnuma would be a new
dependency for two calls. Everything else here is a no-op that says why.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from strata.engine.core.memory.os_pages import PAGE_SIZE_BYTES

log = logging.getLogger(__name__)

SYS_ROOT = Path("/sys")
MPOL_PREFERRED, MPOL_BIND = 1, 2  # <linux/mempolicy.h>
# (mbind, move_pages, get_mempolicy) syscall numbers; the architectures Strata's GPUs come with.
_SYSCALLS = {"x86_64": (237, 279, 239), "aarch64": (235, 239, 236)}
_MPOL_F_ADDR = 2
POLICY_NAMES = {0: "default", 1: "preferred", 2: "bind", 3: "interleave", 4: "local"}
_MASK_WORDS = 16  # a node mask of 1024 bits, the kernel's largest MAX_NUMNODES
_MAX_SAMPLED_PAGES = 4096


@dataclass(frozen=True)
class NumaNode:
    """One node of /sys/devices/system/node: its CPUs and its memory."""

    node: int
    cpus: tuple[int, ...]
    memory_bytes: int | None  # MemTotal of its meminfo; None where the file is missing


@dataclass(frozen=True)
class Placement:
    """Where a host range's pages were asked to go and where a sample of them sits."""

    requested_node: int | None  # None: left to the kernel (first touch)
    policy: str  # "preferred", "bind" or "default"
    note: str  # one line: what was done, or why nothing was
    pages_by_node: dict[int, int]  # node -> sampled pages there (-1: not resident / unknown)

    def as_status(self) -> dict[str, object]:
        """Plain values for /v1/status."""
        return {"requested_node": self.requested_node, "policy": self.policy, "note": self.note,
                "pages_by_node": {str(k): v for k, v in sorted(self.pages_by_node.items())}}


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' (sysfs cpulist format) -> (0, 1, 2, 3, 8, 10, 11); '' -> ()."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return tuple(cpus)


def host_nodes(sys_root: Path = SYS_ROOT) -> list[NumaNode]:
    """The host's NUMA nodes, sorted; [] where sysfs does not list them (not Linux)."""
    nodes = []
    for path in (sys_root / "devices/system/node").glob("node[0-9]*"):
        cpus_file, meminfo = path / "cpulist", path / "meminfo"
        cpus = parse_cpu_list(cpus_file.read_text()) if cpus_file.exists() else ()
        memory_bytes = None
        if meminfo.exists():
            for line in meminfo.read_text().splitlines():
                if "MemTotal:" in line:  # "Node 0 MemTotal:  263741836 kB"
                    memory_bytes = int(line.split()[-2]) * 1024
        nodes.append(NumaNode(int(path.name[4:]), cpus, memory_bytes))
    return sorted(nodes, key=lambda n: n.node)


def normalize_bus_id(bus_id: str) -> str:
    """A PCI address as sysfs names it: NVML's '00000000:3B:00.0' or CUDA's '0000:3B:00.0'
    -> '0000:3b:00.0'."""
    domain, bus, slot = bus_id.strip().lower().rsplit(":", 2)
    return f"{int(domain, 16):04x}:{bus}:{slot}"


def pci_numa_node(bus_id: str, sys_root: Path = SYS_ROOT) -> int | None:
    """The NUMA node of a PCI device; None where sysfs has no node for it (-1, or no file)."""
    path = sys_root / "bus/pci/devices" / normalize_bus_id(bus_id) / "numa_node"
    try:
        node = int(path.read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def cuda_bus_id(device_index: int) -> str | None:
    """The PCI address of CUDA device `device_index` (driver API); None without a driver."""
    try:
        from cuda.bindings import driver as cu

        (err,) = cu.cuInit(0)
        if err == cu.CUresult.CUDA_SUCCESS:
            err, device = cu.cuDeviceGet(device_index)
        if err == cu.CUresult.CUDA_SUCCESS:
            err, raw = cu.cuDeviceGetPCIBusId(32, device)
        if err != cu.CUresult.CUDA_SUCCESS:
            return None
    except Exception:  # noqa: BLE001 - no package, library or driver: no node to look up
        return None
    return bytes(raw).split(b"\0", 1)[0].decode() or None


def gpu_numa_node(device_index: int, sys_root: Path = SYS_ROOT) -> int | None:
    """The NUMA node CUDA device `device_index` is attached to; None where unknown."""
    bus_id = cuda_bus_id(device_index)
    return None if bus_id is None else pci_numa_node(bus_id, sys_root)


def _syscall_numbers() -> tuple[int, int, int] | None:
    return _SYSCALLS.get(platform.machine()) if sys.platform == "linux" else None


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def bind_pages(address: int, size_bytes: int, node: int, policy: int = MPOL_PREFERRED) -> None:
    """mbind(2) the page-aligned range to `node`; pages touched afterwards are allocated there
    (MPOL_PREFERRED: elsewhere once it is full; MPOL_BIND: nowhere else). Pages already
    touched stay where they are. Raises OSError (errno set) where the kernel refuses."""
    numbers = _syscall_numbers()
    if numbers is None:
        raise OSError(errno.ENOSYS, f"mbind is not available on {sys.platform}/{platform.machine()}")
    if not 0 <= node < _MASK_WORDS * 64:
        raise OSError(errno.EINVAL, f"NUMA node {node} is outside the node mask")
    mask = (ctypes.c_ulong * _MASK_WORDS)()
    mask[node // 64] = 1 << (node % 64)
    # maxnode counts one more than the mask's bits: the kernel drops the last (as libnuma does).
    result = _libc().syscall(ctypes.c_long(numbers[0]), ctypes.c_void_p(address),
                             ctypes.c_ulong(size_bytes), ctypes.c_int(policy), mask,
                             ctypes.c_ulong(_MASK_WORDS * 64 + 1), ctypes.c_uint(0))
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mbind to node {node}: {os.strerror(code)}")


def policy_of(address: int) -> tuple[str, tuple[int, ...]]:
    """The memory policy (a POLICY_NAMES name) and its nodes for the page at `address`
    (get_mempolicy(2) with MPOL_F_ADDR). Raises OSError where the kernel refuses."""
    numbers = _syscall_numbers()
    if numbers is None:
        raise OSError(errno.ENOSYS, f"get_mempolicy is not available on {sys.platform}")
    mode, mask = ctypes.c_int(), (ctypes.c_ulong * _MASK_WORDS)()
    result = _libc().syscall(ctypes.c_long(numbers[2]), ctypes.byref(mode), mask,
                             ctypes.c_ulong(_MASK_WORDS * 64 + 1), ctypes.c_void_p(address),
                             ctypes.c_ulong(_MPOL_F_ADDR))
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"get_mempolicy: {os.strerror(code)}")
    nodes = tuple(i for i in range(_MASK_WORDS * 64) if mask[i // 64] >> (i % 64) & 1)
    return POLICY_NAMES.get(mode.value, str(mode.value)), nodes


def page_nodes(address: int, size_bytes: int,
               max_pages: int = _MAX_SAMPLED_PAGES) -> dict[int, int]:
    """node -> how many of up to max_pages pages, evenly spaced over the range, sit there
    (move_pages(2) with no target nodes only reports); -1 counts pages not resident (never
    touched) or not reported. Raises OSError where the kernel refuses."""
    numbers = _syscall_numbers()
    if numbers is None:
        raise OSError(errno.ENOSYS, f"move_pages is not available on {sys.platform}")
    num_pages = max(1, size_bytes // PAGE_SIZE_BYTES)
    step = max(1, num_pages // max_pages)
    sampled = range(0, num_pages, step)
    pages = (ctypes.c_void_p * len(sampled))(*[address + i * PAGE_SIZE_BYTES for i in sampled])
    status = (ctypes.c_int * len(sampled))()
    result = _libc().syscall(ctypes.c_long(numbers[1]), ctypes.c_int(0),
                             ctypes.c_ulong(len(sampled)), pages, None, status, ctypes.c_int(0))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"move_pages: {os.strerror(code)}")
    counts: dict[int, int] = {}
    for node in status:
        key = node if node >= 0 else -1  # -ENOENT: not present; -EFAULT etc.: not reported
        counts[key] = counts.get(key, 0) + 1
    return counts


def numa_maps_nodes(address: int, size_bytes: int,
                    numa_maps: Path = Path("/proc/self/numa_maps")) -> dict[int, int]:
    """node -> resident pages (of the mapping's page size) of the mappings that start inside
    [address, address + size), from numa_maps ("7f.. prefer:0 anon=.. N0=512 N1=3"): where
    move_pages is refused (a container's seccomp may deny it). {} where nothing matches."""
    counts: dict[int, int] = {}
    try:
        lines = numa_maps.read_text().splitlines()
    except OSError:
        return counts
    for line in lines:
        fields = line.split()
        if not fields or not address <= int(fields[0], 16) < address + size_bytes:
            continue
        for field in fields[1:]:
            key, _, value = field.partition("=")
            if key[:1] == "N" and key[1:].isdigit() and value.isdigit():
                counts[int(key[1:])] = counts.get(int(key[1:]), 0) + int(value)
    return counts


def place_near(address: int, size_bytes: int, node: int | None,
               num_nodes: int | None = None) -> Placement:
    """Prefer `node` for the untouched range's pages (MPOL_PREFERRED: a full node spills
    over rather than failing a load); never raises. A no-op, with the reason in the note and
    a log line, where the node is unknown, the host has one node, or the kernel refuses."""
    if num_nodes is None:
        num_nodes = len(host_nodes())
    note = ""
    if node is None:
        note = "the GPU's NUMA node is unknown: pages go where they are first touched"
    elif _syscall_numbers() is None:
        note = f"no mbind on {sys.platform}/{platform.machine()}: pages left to the OS"
    elif num_nodes < 2:
        note = f"one NUMA node ({num_nodes} listed): nothing to place"
    if note:
        log.info("host copy of %d MiB: %s", size_bytes >> 20, note)
        return Placement(None, "default", note, {})
    assert node is not None
    try:
        bind_pages(address, size_bytes, node, MPOL_PREFERRED)
    except OSError as exc:
        note = f"mbind refused ({exc.strerror}): pages go where they are first touched"
        log.warning("host copy of %d MiB near node %d: %s", size_bytes >> 20, node, note)
        return Placement(None, "default", note, {})
    return Placement(node, "preferred", f"pages preferred on NUMA node {node}", {})


def sampled_placement(placement: Placement, address: int, size_bytes: int) -> Placement:
    """`placement` with where a sample of the (now touched) range's pages sits (move_pages;
    else every page, from numa_maps); unchanged where neither tells."""
    try:
        counts = page_nodes(address, size_bytes)
    except OSError as exc:
        log.debug("move_pages of the host copy: %s; reading numa_maps", exc)
        counts = numa_maps_nodes(address, size_bytes)
        if not counts:
            return placement
    return Placement(placement.requested_node, placement.policy, placement.note, counts)
