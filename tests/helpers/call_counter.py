"""Counting the calls of one function a test expects a path to take, the function still run."""

from __future__ import annotations


def count_calls(monkeypatch, owner, name: str) -> list[int]:
    """[calls of owner.name from now on] (one element, read after the run); owner.name is
    replaced for the test by a wrapper that counts and calls the real one."""
    calls = [0]
    real = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls
