"""NUMA placement: the sysfs lookups on a made-up /sys tree, the syscalls for real.

mbind, get_mempolicy and move_pages run against this machine's kernel (one node here, node 0):
a test of the calls, their arguments and errors, not of a second socket.
"""

import platform
import sys

import pytest
import torch

from strata.engine.core.memory import numa, os_pages
from strata.engine.core.memory.host_copy import HostCopy

PAGE = os_pages.PAGE_SIZE_BYTES
has_syscalls = pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"),
    reason="mbind/move_pages through syscall numbers known for Linux x86_64 and aarch64")


def fake_sys(tmp_path):
    """Two nodes (the second with no meminfo) and a GPU on node 1, another with no node."""
    nodes = tmp_path / "devices/system/node"
    (nodes / "node0").mkdir(parents=True)
    (nodes / "node0/cpulist").write_text("0-3,8\n")
    (nodes / "node0/meminfo").write_text(
        "Node 0 MemTotal:       263741836 kB\nNode 0 MemFree:        1000 kB\n")
    (nodes / "node1").mkdir()
    (nodes / "node1/cpulist").write_text("4-7\n")
    (nodes / "possible").write_text("0-1\n")  # not a node directory
    pci = tmp_path / "bus/pci/devices"
    (pci / "0000:3b:00.0").mkdir(parents=True)
    (pci / "0000:3b:00.0/numa_node").write_text("1\n")
    (pci / "0000:86:00.0").mkdir()
    (pci / "0000:86:00.0/numa_node").write_text("-1\n")
    return tmp_path


def test_cpu_lists_parse():
    assert numa.parse_cpu_list("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert numa.parse_cpu_list("") == ()
    assert numa.parse_cpu_list("5") == (5,)


def test_nodes_and_gpu_node_from_a_sys_tree(tmp_path):
    root = fake_sys(tmp_path)
    assert numa.host_nodes(root) == [
        numa.NumaNode(0, (0, 1, 2, 3, 8), 263741836 * 1024), numa.NumaNode(1, (4, 5, 6, 7), None)]
    # NVML's and CUDA's spellings of one address both find sysfs's lower-case name.
    assert numa.normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert numa.pci_numa_node("00000000:3B:00.0", root) == 1
    assert numa.pci_numa_node("0000:3B:00.0", root) == 1
    assert numa.pci_numa_node("0000:86:00.0", root) is None  # -1: the firmware gave no node
    assert numa.pci_numa_node("0000:99:00.0", root) is None  # no such device
    assert numa.host_nodes(tmp_path / "nothing") == []


@has_syscalls
def test_bound_pages_land_on_the_node_and_move_pages_reports_it():
    pages = os_pages.allocate(64 * PAGE)
    try:
        # Untouched pages are not resident yet: move_pages reports no node for them.
        assert numa.page_nodes(pages.address, 64 * PAGE) == {-1: 64}
        numa.bind_pages(pages.address, 64 * PAGE, 0, numa.MPOL_BIND)
        assert numa.policy_of(pages.address) == ("bind", (0,))
        torch.frombuffer(pages.buffer, dtype=torch.uint8).fill_(7)  # first touch
        assert numa.page_nodes(pages.address, 64 * PAGE) == {0: 64}
        assert numa.page_nodes(pages.address, 64 * PAGE, max_pages=8) == {0: 8}
        missing = max(n.node for n in numa.host_nodes()) + 1
        with pytest.raises(OSError, match=f"mbind to node {missing}"):
            numa.bind_pages(pages.address, 64 * PAGE, missing, numa.MPOL_BIND)
    finally:
        pages.close()


def test_numa_maps_counts_the_ranges_pages_by_node(tmp_path):
    maps = tmp_path / "numa_maps"
    maps.write_text("7f0000000000 prefer:0 anon=512 dirty=512 N0=500 N1=12 kernelpagesize_kB=4\n"
                    "7f0000200000 default anon=3 N1=3 kernelpagesize_kB=4\n"
                    "7f0000400000 default anon=9 N0=9 kernelpagesize_kB=4\n")
    assert numa.numa_maps_nodes(0x7F0000000000, 0x400000, maps) == {0: 500, 1: 15}
    assert numa.numa_maps_nodes(0x10000, 4096, maps) == {}
    assert numa.numa_maps_nodes(0x7F0000000000, 4096, tmp_path / "missing") == {}


@has_syscalls
def test_numa_maps_of_this_process_sees_touched_pages():
    pages = os_pages.allocate(64 * PAGE)
    try:
        # Its own policy keeps the range one mapping of its own (no merge with a neighbour).
        numa.bind_pages(pages.address, 64 * PAGE, 0, numa.MPOL_BIND)
        torch.frombuffer(pages.buffer, dtype=torch.uint8).fill_(3)
        assert numa.numa_maps_nodes(pages.address, 64 * PAGE) == {0: 64}
    finally:
        pages.close()


@has_syscalls
def test_place_near_prefers_the_node_and_never_raises():
    pages = os_pages.allocate(16 * PAGE)
    try:
        unknown = numa.place_near(pages.address, 16 * PAGE, None, num_nodes=2)
        assert unknown.requested_node is None and "unknown" in unknown.note
        single = numa.place_near(pages.address, 16 * PAGE, 0, num_nodes=1)
        assert single.policy == "default" and "one NUMA node" in single.note
        assert numa.policy_of(pages.address)[0] == "default"  # neither changed the range
        missing = max(n.node for n in numa.host_nodes()) + 1
        refused = numa.place_near(pages.address, 16 * PAGE, missing, num_nodes=2)
        assert refused.policy == "default" and "mbind refused" in refused.note
        placed = numa.place_near(pages.address, 16 * PAGE, 0, num_nodes=2)
        assert (placed.requested_node, placed.policy) == (0, "preferred")
        assert numa.policy_of(pages.address) == ("preferred", (0,))
    finally:
        pages.close()


@has_syscalls
def test_host_copy_asks_for_the_gpus_node_and_records_where_pages_are(monkeypatch):
    # No GPU here: the lookup answers node 0 and the host claims two nodes; mbind is real.
    monkeypatch.setattr(numa, "gpu_numa_node", lambda index: 0)
    real_place_near = numa.place_near
    monkeypatch.setattr(numa, "place_near", lambda address, size, node: real_place_near(
        address, size, node, num_nodes=2))
    host = HostCopy(32 * PAGE, near_device=0)
    assert numa.policy_of(host.tensor(0, (1,), torch.uint8).data_ptr()) == ("preferred", (0,))
    host.tensor(0, (32 * PAGE,), torch.uint8).fill_(1)
    placement = host.sample_placement()
    assert placement.pages_by_node == {0: 32} and placement.requested_node == 0
    assert placement.as_status() == {"requested_node": 0, "policy": "preferred",
                                     "note": "pages preferred on NUMA node 0",
                                     "pages_by_node": {"0": 32}}
    host.close()


def test_a_host_copy_with_no_device_is_left_alone():
    host = HostCopy(4 * PAGE)
    assert host.placement.as_status() == {"requested_node": None, "policy": "default",
                                          "note": "not placed", "pages_by_node": {}}
    if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64"):
        assert numa.policy_of(host.tensor(0, (1,), torch.uint8).data_ptr())[0] == "default"
    host.close()
