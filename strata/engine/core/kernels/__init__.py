"""Kernel plumbing that the reference model and the fast path share.

The reference model (models/, through quant/ for GGUF blocks) and the fast path (fast/) both
launch these; neither owns them, so that models/ never imports fast/:

- launch.py            is Triton usable here, autotuning, launching a tuned kernel
- pdl.py               programmatic dependent launch for chained Triton kernels
- prefill_attention.py causal attention on fused SDPA kernels (never [heads, T, S] scores)
"""
