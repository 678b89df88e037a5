"""Errors of the host-side text layer; every message is one line that says what to do."""

from __future__ import annotations

from strata.errors import StrataError


class TextAssetsError(StrataError, ValueError):
    """A tokenizer or chat template that Strata cannot build from the model's files."""


class ChatTemplateError(StrataError, ValueError):
    """A chat template that failed to render: it raised, looped, or produced too much text."""
