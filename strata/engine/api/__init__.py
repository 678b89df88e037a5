"""Strata's HTTP API: OpenAI, Anthropic, llama.cpp-style and control routes over a service."""

from strata.engine.api.app import create_app

__all__ = ["create_app"]
