"""Strata: a local LLM server that shares one GPU and gives VRAM back in stages."""
__version__ = "0.1.0"
