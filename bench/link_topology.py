"""The host side of a GPU's link, as plain values: CPU, NUMA nodes, the GPU's node, PCIe, IOMMU.

Read from /proc, /sys and NVML only (no CUDA context), so it runs on a CPU machine too; used
by diag_link.py, which times the link itself.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata

from strata.engine.core.memory import numa

SYS_ROOT = numa.SYS_ROOT


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first 'model name' of /proc/cpuinfo; None where there is none."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def iommu(sys_root: Path = SYS_ROOT, cmdline: Path = Path("/proc/cmdline")) -> dict[str, Any]:
    """Whether an IOMMU is on: its /sys/class/iommu units, its groups and the kernel's
    iommu= / intel_iommu= / amd_iommu= arguments (passthrough 'pt' makes DMA untranslated)."""
    units = sorted(p.name for p in (sys_root / "class/iommu").glob("*"))
    groups = sys_root / "kernel/iommu_groups"
    num_groups = sum(1 for _ in groups.glob("*")) if groups.exists() else 0
    try:
        arguments = [a for a in cmdline.read_text().split() if "iommu" in a]
    except OSError:
        arguments = []
    return {"is_on": bool(units) or num_groups > 0, "units": units, "num_groups": num_groups,
            "kernel_arguments": arguments}


def pcie_link(bus_id: str) -> dict[str, Any] | None:
    """NVML's PCIe generation and width, now and at most, for the GPU at bus_id; None
    without NVML. The current figures drop while the GPU idles: read them under load too."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        return {"gen": pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle),
                "width": pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle),
                "max_gen": pynvml.nvmlDeviceGetMaxPcieLinkGeneration(handle),
                "max_width": pynvml.nvmlDeviceGetMaxPcieLinkWidth(handle)}
    except Exception as exc:  # noqa: BLE001 - no NVML, driver or permission: say so
        return {"error": str(exc) or type(exc).__name__}


def gpu_topology(device_index: int, sys_root: Path = SYS_ROOT) -> dict[str, Any] | None:
    """The GPU's PCI address, NUMA node, local CPUs and link; None without a CUDA driver."""
    bus_id = numa.cuda_bus_id(device_index)
    if bus_id is None:
        return None
    local = sys_root / "bus/pci/devices" / numa.normalize_bus_id(bus_id) / "local_cpulist"
    return {"bus_id": bus_id, "numa_node": numa.pci_numa_node(bus_id, sys_root),
            "local_cpus": numa.parse_cpu_list(local.read_text()) if local.exists() else None,
            "pcie": pcie_link(bus_id)}


def host_topology(device_index: int = 0, sys_root: Path = SYS_ROOT) -> dict[str, Any]:
    """Everything above, and which nodes this process's CPUs are on (first touch puts
    unbound pages on the node of the CPU that touches them)."""
    nodes = numa.host_nodes(sys_root)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {
        "cpu_model": cpu_model(),
        "nodes": [{"node": n.node, "num_cpus": len(n.cpus), "cpus": n.cpus,
                   "memory_gib": None if n.memory_bytes is None else n.memory_bytes / 2**30}
                  for n in nodes],
        "process_cpus": cpus,
        "process_nodes": sorted({n.node for n in nodes for c in cpus if c in n.cpus}),
        "iommu": iommu(sys_root),
        "gpu": gpu_topology(device_index, sys_root),
    }


def format_topology(topology: dict[str, Any]) -> str:
    """A few lines for a person: CPU, nodes, the GPU's node and link, IOMMU."""
    lines = [f"CPU: {topology['cpu_model']}"]
    for node in topology["nodes"]:
        memory = "?" if node["memory_gib"] is None else f"{node['memory_gib']:.0f} GiB"
        lines.append(f"NUMA node {node['node']}: {node['num_cpus']} CPUs, {memory}")
    lines.append(f"this process runs on nodes {topology['process_nodes']}")
    gpu = topology["gpu"]
    if gpu is None:
        lines.append("GPU: none (no CUDA driver)")
    else:
        lines.append(f"GPU {gpu['bus_id']}: NUMA node {gpu['numa_node']}, PCIe {gpu['pcie']}")
    mmu = topology["iommu"]
    lines.append(f"IOMMU: {'on' if mmu['is_on'] else 'off'} ({len(mmu['units'])} units, "
                 f"{mmu['num_groups']} groups, kernel arguments {mmu['kernel_arguments']})")
    return "\n".join(lines)
