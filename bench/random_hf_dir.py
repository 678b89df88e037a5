"""Write a random-weight preset as a real Hugging Face directory, for load-from-file benchmarks.

    python bench/random_hf_dir.py smollm2-135m /tmp/smollm2   # writes config.json + shards

config.json is the preset's (strata.engine.core.random_weights); the weights are bf16,
normal(0, 0.02) with norms at 1 (the same values `--random-weights` draws), saved in
safetensors shards of at most 4 GiB with an index, under the names a Hugging Face checkpoint
uses (MoE experts one tensor per expert, router `mlp.gate`), so loading goes through the same
sanitize() as a downloaded model.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for strata

MAX_SHARD_BYTES = 4 << 30
_PAGE_CACHE_READ_BYTES = 64 << 20
_STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")


def _on_disk(name: str, tensor):
    """(file name, tensor) pairs for one canonical tensor: stacked experts are split per expert."""
    match = _STACKED_EXPERTS.match(name)
    if match:
        prefix, proj = match.groups()
        return [(f"{prefix}.{e}.{proj}.weight", t.clone()) for e, t in enumerate(tensor)]
    return [(name.replace(".mlp.router.weight", ".mlp.gate.weight"), tensor)]


def write_random_hf_dir(
    preset: str,
    directory: str | Path,
    device: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> int:
    """Write config.json and bf16 safetensors shards for `preset` into `directory`; returns the
    bytes of tensor data written. Tensors are drawn on `device` (the GPU when there is one, as
    CPU normal_ of 8B parameters takes minutes) and saved one shard at a time."""
    import torch
    from safetensors.torch import save_file

    from strata.engine.core.models.registry import model_module
    from strata.engine.core.random_weights import random_weights_config, random_weights_hf_config
    from strata.engine.core.weight_source import RandomWeights

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = random_weights_config(preset)
    with torch.device("meta"):
        shapes = {
            n: tuple(p.shape)
            for n, p in model_module(config.model_type).Model(config).named_parameters()
        }
    # Plan the shards first: their names carry the total count.
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, shape in shapes.items():
        size_bytes = torch.Size(shape).numel() * 2
        if shards[-1] and shard_bytes + size_bytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += size_bytes

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(random_weights_hf_config(preset), indent=2))
    source = RandomWeights(torch.device(device))
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for i, names in enumerate(shards):
        file_name = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {}
        for name in names:
            tensor = source.tensor(name, shapes[name], torch.bfloat16).cpu()
            for disk_name, part in _on_disk(name, tensor):
                tensors[disk_name] = part
                weight_map[disk_name] = file_name
            total_bytes += tensor.numel() * 2
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if device == "cuda":
        torch.cuda.empty_cache()
    return total_bytes


def warm_page_cache(directory: str | Path) -> int:
    """Read every file of `directory` once, so a load finds them in the OS page cache (as for
    a user who loaded the model before); returns the bytes read."""
    buffer = bytearray(_PAGE_CACHE_READ_BYTES)
    total_bytes = 0
    for path in sorted(Path(directory).iterdir()):
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total_bytes += n
    return total_bytes


if __name__ == "__main__":
    print(f"{write_random_hf_dir(sys.argv[1], sys.argv[2]) / 1e9:.2f} GB written")
