"""Counting what a model holds as GGML blocks: quantized linears and embeddings (weight.py)
and stacked experts (experts.py), for the load's log line and `Engine.info`."""

from __future__ import annotations

from torch import nn

from strata.engine.core.quant.experts import QuantizedExperts
from strata.engine.core.quant.weight import QuantizedEmbedding, QuantizedLinear


def _quantized_expert_stacks(model: nn.Module) -> list[QuantizedExperts]:
    return [w for m in model.modules() for w in vars(m).values()
            if isinstance(w, QuantizedExperts)]


def count_quantized(model: nn.Module) -> int:
    """How many of the model's weights (stacked experts included) are held as GGML blocks."""
    return (sum(isinstance(m, QuantizedLinear | QuantizedEmbedding) for m in model.modules())
            + len(_quantized_expert_stacks(model)))


def count_parameters(model: nn.Module) -> int:
    """Float parameters plus the values quantized weights hold."""
    quantized = sum(m.weight.numel() for m in model.modules()
                    if isinstance(m, QuantizedLinear | QuantizedEmbedding))
    quantized += sum(w.numel() for w in _quantized_expert_stacks(model))
    return quantized + sum(p.numel() for p in model.parameters())
