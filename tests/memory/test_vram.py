"""vram.py: NVML absent answers None/[]; CUDA_VISIBLE_DEVICES maps CUDA ordinals to NVML ones."""

import pytest

from strata.engine.core.memory import vram


def test_without_nvml_answers_none():
    if vram._load_nvml() is not None:
        pytest.skip("NVML is present here; tests/gpu checks real figures")
    assert vram.read_free_vram_bytes() is None
    assert vram.read_vram_info() is None
    assert vram.gpu_processes() == []


class _Nvml:
    """Just enough of pynvml to see which handle a CUDA ordinal resolves to."""

    @staticmethod
    def nvmlDeviceGetHandleByIndex(index):
        return ("index", index)

    @staticmethod
    def nvmlDeviceGetHandleByUUID(uuid):
        return ("uuid", uuid)


def test_cuda_ordinals_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abc")
    assert vram._device_handle(_Nvml, 0) == ("index", 3)
    assert vram._device_handle(_Nvml, 1) == ("uuid", "GPU-abc")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert vram._device_handle(_Nvml, 2) == ("index", 2)
