"""Build an architecture's Model from a config and canonical tensors, checking every one."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch

from strata.engine.core.model_config import ModelConfig, ModelFormatError
from strata.engine.core.models.registry import model_module
from strata.engine.core.quant.weight import QuantizedWeight, install_quantized

# Parameters kept in float32 whatever the compute dtype: GLM's routing bias only chooses
# experts, by differences far below bf16's step at its magnitude (transformers keeps it
# float32 too).
_FLOAT32_PARAMETERS = ("e_score_correction_bias",)


def parameter_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype parameter `name` is held in when the model computes in `dtype`."""
    return torch.float32 if name.endswith(_FLOAT32_PARAMETERS) else dtype


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
            source = getattr(tensors[name], "source_name", None)  # a GGUF's own name
            raise ModelFormatError(
                f"tensor {name}{f' ({source} in the file)' if source else ''} has shape "
                f"{actual} but the config expects {shape}: the file is damaged or its "
                f"{'metadata' if source else 'config.json'} does not match"
            )


def build_model(
    config: ModelConfig,
    tensors: dict[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    placeholders: Collection[str] = (),
    quantized: Mapping[str, QuantizedWeight] | None = None,
) -> torch.nn.Module:
    """The architecture's Model on `device` in `dtype`, its parameters taken from `tensors`.

    `tensors` are canonical (after sanitize). The model is built on the meta device first so
    the only memory used is the tensors themselves, cast or moved only where needed: a tensor
    already of `dtype` on `device` (e.g. a view into a memory arena) is taken over as it is.
    `placeholders` name parameters that stay on the meta device because someone else supplies
    them at run time (an expert cache's provider); a forward that reads one fails loudly.
    `quantized` names weights held as GGML blocks: their Linear / Embedding modules become
    quantized twins (quant/weight.py) and read them through qlinear.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = model_module(config.model_type).Model(config)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    unknown = sorted(set(placeholders) - set(expected))
    if unknown:
        raise ValueError(f"placeholders {unknown} are not parameters of {config.model_type}")
    quantized = dict(quantized or {})
    check_tensors({n: s for n, s in expected.items() if n not in placeholders},
                  {**tensors, **quantized})
    install_quantized(model, quantized)
    # .to() returns the same tensor when dtype and device already match: no copy then.
    state = {
        name: tensors[name].to(device=device, dtype=parameter_dtype(name, dtype))
        for name in expected
        if name not in placeholders and name not in quantized
    }
    model.load_state_dict(state, strict=False, assign=True)
    # Buffers (the non-persistent RoPE tables, built on the CPU) move; the parameters are
    # where they belong already, and meta placeholders cannot move.
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, buffer.to(device))
    model.requires_grad_(False)
    model.eval()
    return model
