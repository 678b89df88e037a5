"""Load-time tuning results kept on disk, per GPU and per model (issue 18 item 6).

A load measures which prefill element-wise groups are faster and how long a prompt a prefill
graph should take (tuning.py); on the same GPU, software and model the answer is the same,
so a later load reads it back and skips the timing runs. The key has two parts:
- the device: GPU name, compute capability, driver, CUDA, torch and Triton versions;
- the model's content: its config, every module's class, and each weight's shape, dtype and
  GGML type (never the file's path: a copied or renamed file is the same model), plus the
  decoder's settings that change what is timed (chunk, MoE path, kernels, graphs).
The decode kernels' correctness checks are kept the same way (kind "kernels", with a hash of
the kernels' source in the key: kernel_checks.py).
One small JSON file per key under kernel_cache_dir()/tuning, written to a temp name and
renamed; a file that is unreadable, of another schema or of another key is ignored with one
log line, and the load tunes again and overwrites it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
FILE_PREFIX = "prefill-"  # the prefill timings' files; kernel checks' are "kernels-"


@dataclasses.dataclass(frozen=True)
class TuningKey:
    """What a stored result is valid for: the device's and the model's identity, and the
    decoder settings that change the measurement. Plain JSON values only."""

    device: Mapping[str, Any]
    model: Mapping[str, Any]
    settings: Mapping[str, Any]
    # What is stored: "prefill" (tuning.py's timings) or "kernels" (kernel_checks.py's
    # verdicts); the file name's prefix, so the two never share a file.
    kind: str = "prefill"

    def as_json(self) -> dict[str, Any]:
        """The key as stored in the file (compared whole on read)."""
        # A JSON round trip: tuples become lists, as they come back from the file.
        return json.loads(json.dumps({"device": self.device, "model": self.model,
                                      "settings": self.settings}, sort_keys=True))

    @property
    def digest(self) -> str:
        """A short hex name for the file: a hash of the whole key."""
        text = json.dumps(self.as_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def default_dir() -> Path:
    """Where tuning results live: next to the compiled kernels they go with."""
    from strata.paths import kernel_cache_dir

    return kernel_cache_dir() / "tuning"


class TuningStore:
    """One JSON file per TuningKey in `directory` (created on the first write)."""

    def __init__(self, directory: str | os.PathLike[str] | None = None):
        self.directory = Path(directory) if directory is not None else default_dir()

    def path_for(self, key: TuningKey) -> Path:
        return self.directory / f"{key.kind}-{key.digest}.json"

    def read(self, key: TuningKey) -> dict[str, Any] | None:
        """The result stored for key, or None: none stored, or one that is corrupt, of
        another schema or of another key (logged once; the caller tunes again)."""
        path = self.path_for(key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.info("tuning result %s unreadable (%s); tuning again", path, exc)
            return None
        problem, result = _parse(text, key)
        if problem:
            log.info("tuning result %s ignored (%s); tuning again", path, problem)
            return None
        return result

    def write(self, key: TuningKey, result: Mapping[str, Any]) -> Path | None:
        """Store result for key atomically (temp file, fsync, rename): a reader sees the old
        file or the new one, never half of one. Returns the path; None when the directory is
        not writable (logged: the next load tunes again, nothing else changes)."""
        record = {"schema": SCHEMA_VERSION, "key": key.as_json(), "result": dict(result)}
        text = json.dumps(record, indent=1, sort_keys=True)
        path = self.path_for(key)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp",
                                        dir=self.directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as handle:
                    handle.write(text)
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
        except OSError as exc:
            log.info("tuning result not stored in %s (%s); the next load tunes again",
                     self.directory, exc)
            return None
        return path


def _parse(text: str, key: TuningKey) -> tuple[str, dict[str, Any] | None]:
    """('', result) for a valid record of key; (why not, None) otherwise."""
    try:
        record = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}", None
    if not isinstance(record, dict):
        return "not a JSON object", None
    if record.get("schema") != SCHEMA_VERSION:
        return f"schema {record.get('schema')!r}, expected {SCHEMA_VERSION}", None
    if record.get("key") != key.as_json():
        return "written for another GPU, model or version", None
    result = record.get("result")
    if not isinstance(result, dict):
        return "no result object", None
    return "", result


# ---- the key's parts ----------------------------------------------------------------------


def device_identity(device) -> dict[str, Any]:
    """The device and the software whose change can change a timing: GPU name, compute
    capability, driver, CUDA runtime, torch and Triton versions."""
    import torch

    identity: dict[str, Any] = {"type": device.type, "torch": torch.__version__,
                                "triton": _triton_version()}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        identity.update(
            name=torch.cuda.get_device_name(index),
            capability=list(torch.cuda.get_device_capability(index)),
            driver=_driver_version(),
            cuda=torch.version.cuda,
        )
    return identity


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", None)


def _driver_version() -> str:
    """The NVIDIA driver's version (NVML: "550.54.15"); the CUDA driver API's number where
    NVML is missing; "unknown" if neither answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # noqa: BLE001 - NVML missing or unusable: try the driver API
        pass
    try:
        from cuda.bindings import driver

        error, version = driver.cuDriverGetVersion()
        if int(error) == 0:
            return f"cuda-driver-api {version}"
    except Exception:  # noqa: BLE001 - no cuda-python here
        pass
    return "unknown"


def model_identity(model) -> dict[str, Any]:
    """What the model is, from its content: the config, and per module its class and each
    weight's shape, dtype and GGML type; hashed (the list is long for a large model)."""
    digest = hashlib.blake2b(digest_size=16)
    config = getattr(model, "config", None)
    if dataclasses.is_dataclass(config):
        digest.update(json.dumps(dataclasses.asdict(config), sort_keys=True,
                                 default=str).encode())
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__name__};".encode())
        for attr, value in sorted(vars(module).items()):
            entry = _weight_entry(value)
            if entry:
                digest.update(f"{attr}={entry};".encode())
        for attr, tensor in module.named_parameters(recurse=False):
            digest.update(f"{attr}={_tensor_entry(tensor)};".encode())
    model_type = getattr(config, "model_type", type(model).__name__)
    return {"model_type": model_type, "content": digest.hexdigest()}


def _tensor_entry(tensor) -> str:
    return f"{tuple(tensor.shape)}:{str(tensor.dtype).removeprefix('torch.')}"


def _weight_entry(value) -> str:
    """A quantized weight's (or expert stack's) GGML type and shape; '' for anything else."""
    qtype = getattr(value, "qtype", None)
    if qtype is None:
        qtypes = getattr(value, "qtypes", None)
        qtype = ",".join(getattr(t, "name", str(t)) for t in qtypes) if qtypes else None
    if qtype is None:
        return ""
    return f"{getattr(qtype, 'name', qtype)}:{tuple(getattr(value, 'shape', ()))}"
