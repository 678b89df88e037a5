"""Continuous batching in the engine core: sequences, slot choice, the step scheduler.

Synchronous (STYLE §6): the engine's add / cancel / step drive it; the engine process loop
(core/process.py) calls step between reading commands.
"""
