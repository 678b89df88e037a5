"""bench/diag_link.py without a GPU: the topology part runs and exits 0, the in-place read
kernel sums a registered-style host buffer right (Triton's CPU interpreter), the placements
and the table follow the topology and the rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Must precede the first Triton import: triton.jit picks the interpreter at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import diag_link
import link_topology

from strata.engine.core.memory.host_copy import HostCopy
from strata.units import KIB, MIB
from tests.helpers.child_env import REPO, child_env


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_it_prints_the_host_and_exits_0(tmp_path) -> None:
    out = tmp_path / "link.json"
    done = subprocess.run([sys.executable, "bench/diag_link.py", "--json", str(out)], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout and "NUMA node 0:" in done.stdout
    report = json.loads(out.read_text())
    assert report["placements"] == [] and report["topology"]["gpu"] is None
    assert report["topology"]["nodes"][0]["node"] == 0
    assert set(report["topology"]["process_nodes"]) <= {n["node"] for n in
                                                         report["topology"]["nodes"]}


def test_iommu_is_read_from_sysfs(tmp_path) -> None:
    (tmp_path / "class/iommu/dmar0").mkdir(parents=True)
    for group in ("0", "1"):
        (tmp_path / "kernel/iommu_groups" / group).mkdir(parents=True)
    cmdline = tmp_path / "cmdline"
    cmdline.write_text("ro quiet intel_iommu=on iommu=pt\n")
    assert link_topology.iommu(tmp_path, cmdline) == {
        "is_on": True, "units": ["dmar0"], "num_groups": 2,
        "kernel_arguments": ["intel_iommu=on", "iommu=pt"]}
    assert link_topology.iommu(tmp_path / "none", cmdline)["is_on"] is False


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU interpreter")
def test_the_read_kernel_sums_the_host_buffer_through_an_offset() -> None:
    host = HostCopy(MIB)
    src = host.tensor(0, (MIB,), torch.uint8)
    src.copy_(torch.randint(0, 256, (MIB,), dtype=torch.uint8, generator=torch.manual_seed(3)))
    base = torch.zeros(64, dtype=torch.int32)  # another allocation, as the device's `out`
    offset = (src.data_ptr() - base.data_ptr()) // 4
    assert diag_link.read_checks(base, offset, src)
    src[5 * 4096 + 1] = 0  # a byte of tile 5 (of 4 KiB), which program 1 of 4 sums
    diag_link.read_in_place(base, offset, 64 * KIB, 4, base)
    before = base[:4].clone()
    src[5 * 4096 + 1] = 1  # the int32's second byte: +256
    diag_link.read_in_place(base, offset, 64 * KIB, 4, base)
    assert (base[:4] - before).tolist() == [0, 256, 0, 0]
    del src
    host.close()


def test_placements_follow_the_gpus_node() -> None:
    def topology(nodes, gpu_node):
        return {"nodes": [{"node": n} for n in nodes], "gpu": {"numa_node": gpu_node}}

    assert diag_link.placements(topology([0, 1], 1)) == [
        ("first touch", None), ("GPU node 1", 1), ("far node 0", 0)]
    assert diag_link.placements(topology([0], 0)) == [("first touch", None), ("GPU node 0", 0)]
    assert diag_link.placements(topology([0, 1], None)) == [
        ("first touch", None), ("node 0", 0), ("node 1", 1)]
    assert diag_link.placements({"nodes": [{"node": 0}], "gpu": None}) == [("first touch", None)]


def test_the_table_compares_against_big_copies_and_uncontended_rates() -> None:
    copies = [{"copy_bytes": size, "gb_s": 10.0 if size == MIB else 50.0,
               "is_host_bound": size == 64 * KIB} for size in diag_link.COPY_SIZES_BYTES]
    reads = [{"read_bytes": size, "grid": grid, "gb_s": 20.0, "is_host_bound": False}
             for size in diag_link.READ_SIZES_BYTES for grid in (132, 528)]
    row = {"label": "far node 0", "copies": copies, "reads": reads,
           "contention": {"grid": 528, "copy_gb_s": 5.0, "read_gb_s": 15.0, "both_gb_s": 20.0}}
    figures = {f["figure"]: f for f in diag_link.placement_figures(row)}
    assert figures["far node 0 copy 1024 KiB"]["ratio"] == pytest.approx(0.2)
    assert "far node 0 copy 64 KiB (host-bound)" in figures
    assert figures["far node 0 contended: 1 MiB copies"]["ratio"] == pytest.approx(0.5)
    assert figures["far node 0 contended: read grid 528"]["ratio"] == pytest.approx(0.75)
    error = diag_link.placement_figures({"label": "node 1", "error": "mbind to node 1: EINVAL"})
    assert error[0]["value"] is None
