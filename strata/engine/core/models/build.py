"""Build an architecture's Model from a config and canonical tensors, checking every one."""

from __future__ import annotations

import torch

from strata.engine.core.model_config import ModelConfig, ModelFormatError
from strata.engine.core.models.registry import model_module


def check_tensors(expected: dict[str, tuple[int, ...]], tensors: dict[str, torch.Tensor]) -> None:
    """Raise ModelFormatError for the first missing, unexpected or misshapen tensor."""
    for name in expected:
        if name not in tensors:
            raise ModelFormatError(
                f"missing tensor {name}: the file is incomplete or its config.json does not match"
            )
    for name in tensors:
        if name not in expected:
            raise ModelFormatError(
                f"unexpected tensor {name}: the file is not the architecture its config "
                "names, or config.json does not match"
            )
    for name, shape in expected.items():
        actual = tuple(tensors[name].shape)
        if actual != shape:
            raise ModelFormatError(
                f"tensor {name} has shape {actual} but the config expects {shape}: "
                "the file is damaged or its config.json does not match"
            )


def build_model(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """The architecture's Model on `device` in `dtype`, its parameters taken from `tensors`.

    `tensors` are canonical (after sanitize). The model is built on the meta device first so
    the only memory used is the tensors themselves, cast or moved only where needed.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = model_module(config.model_type).Model(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    check_tensors(expected, tensors)
    # .to() returns the same tensor when dtype and device already match: no copy then.
    state = {name: tensors[name].to(device=device, dtype=dtype) for name in expected}
    model.load_state_dict(state, strict=True, assign=True)
    # Moves the non-persistent RoPE buffer (built on the CPU); parameters are already there.
    model.to(device)
    model.requires_grad_(False)
    model.eval()
    return model
