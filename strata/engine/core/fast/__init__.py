"""Fast paths for the GPU: CUDA-graph decode, grouped MoE experts, flash-friendly prefill.

Every path here has a plain-torch twin that runs on the CPU; tests compare the two. Nothing in
this package changes a model's weights or their addresses (the weights arena owns those).
The reference model (models/) never imports this package; this package builds on it.
"""

from strata.engine.core.fast.decode_graph import GraphDecoder
from strata.engine.core.fast.forward import decode_step
from strata.engine.core.fast.prefill import prefill
from strata.engine.core.fast.static_step import kv_buckets

__all__ = ["GraphDecoder", "decode_step", "kv_buckets", "prefill"]
