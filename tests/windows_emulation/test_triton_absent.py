"""Triton present and absent (STRATA_EMULATE_NO_TRITON=1, Windows without triton-windows): the
host's VRAM sizing, its status notice and the engine's load follow what the engine really maps.

Each case runs in a child process with the emulation on PYTHONPATH, so that "absent" is what
every module (torch's included) sees, as on a machine without the package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

pytestmark = pytest.mark.timeout(300)
HERE = Path(__file__).parent
REPO = HERE.parent.parent


def _run(code: str, *, no_triton: bool, **env: str) -> dict:
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)]), **env}
    child_env.pop("STRATA_EMULATE_NO_TRITON", None)
    if no_triton:
        child_env["STRATA_EMULATE_NO_TRITON"] = "1"
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env,
                          capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"stderr": done.stderr}


def _q8_gguf(path: Path) -> tuple[int, int]:
    """A GGUF with one Q8_0 projection and one F32 norm; (Q8_0 bytes, total values)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    weight = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    blocks = quantize(weight, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_shape=blocks.shape,
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(256, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return blocks.nbytes, weight.size + 256


def test_emulation_hides_triton_from_every_module():
    probe = """
        import importlib.util, json
        try:
            import triton  # noqa: F401
            imported = True
        except ImportError:
            imported = False
        print(json.dumps({"imported": imported,
                          "spec": importlib.util.find_spec("triton") is not None}))
    """
    assert _run(probe, no_triton=False) | {"stderr": ""} == {
        "imported": True, "spec": True, "stderr": ""}
    assert _run(probe, no_triton=True) | {"stderr": ""} == {
        "imported": False, "spec": False, "stderr": ""}


@pytest.mark.parametrize("no_triton", [False, True])
def test_the_guard_sizes_gguf_blocks_as_the_engine_will_hold_them(tmp_path, no_triton):
    q8_bytes, values = _q8_gguf(tmp_path / "m.gguf")
    found = _run(f"""
        import json
        from strata.engine.service.load_size import stored_size
        from strata.engine.triton_support import gpu_kernel_notice
        size = stored_size({str(tmp_path / "m.gguf")!r})
        print(json.dumps({{"dense": size.dense_bytes, "notice": gpu_kernel_notice("auto"),
                          "cpu_notice": gpu_kernel_notice("cpu")}}))
    """, no_triton=no_triton)
    norm_bf16 = 256 * 2
    if no_triton:  # expanded to bf16 at load: what the engine maps without Triton
        assert found["dense"] == values * 2
        assert "Triton is not available" in found["notice"]
    else:
        assert found["dense"] == q8_bytes + norm_bf16
        assert found["notice"] is None
    assert found["cpu_notice"] is None  # the CPU expands anyway: nothing to warn about


@pytest.mark.parametrize("no_triton", [False, True])
def test_the_status_carries_the_notice_for_a_gpu(no_triton):
    found = _run("""
        import json
        from strata.engine.service.service import Service
        from strata.engine.service.settings import ServeSettings
        gpu = Service(ServeSettings(), vram_reader=lambda: 8 << 30)
        cpu = Service(ServeSettings(device="cpu"), vram_reader=lambda: 8 << 30)
        print(json.dumps({"gpu": gpu.kernel_notice(None), "cpu": cpu.kernel_notice(None),
                          "loaded": gpu.kernel_notice({"kernel_notice": None})}))
    """, no_triton=no_triton)
    assert (found["gpu"] is not None) == no_triton
    assert found["cpu"] is None and found["loaded"] is None  # the engine's word wins


@pytest.mark.parametrize("no_triton", [False, True])
def test_the_engine_keeps_blocks_only_with_triton_and_says_so_at_load(smollm2_gguf, no_triton,
                                                                      tmp_path):
    """On the CPU with STRATA_QUANTIZED=1 and the interpreter, the engine keeps GGUF blocks as
    on CUDA: the same decision, made here where it can run."""
    found = _run(f"""
        import json, logging
        logging.basicConfig(level=logging.WARNING)
        from strata.engine.core.engine import Engine
        from strata.engine.core.engine_config import EngineConfig
        from strata.engine.core.quant.census import count_quantized
        engine = Engine(EngineConfig(model_path={str(smollm2_gguf)!r}, device="cpu",
                                     context_tokens=256, snapshot_dir={str(tmp_path)!r}))
        info = engine.load()
        print(json.dumps({{"kept": count_quantized(engine.model),
                          "notice": info["kernel_notice"]}}))
        engine.close()
    """, no_triton=no_triton, STRATA_QUANTIZED="1", TRITON_INTERPRET="1")
    if no_triton:
        assert found["kept"] == 0
        assert "Triton is not available" in found["notice"]
        notices = [line for line in found["stderr"].splitlines() if "Triton is not" in line]
        assert len(notices) == 1, found["stderr"]  # one line at load
    else:
        assert found["kept"] > 0 and found["notice"] is None
        assert "Triton is not" not in found["stderr"]
