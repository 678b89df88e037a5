"""The OpenAPI document lists exactly the routes the app registers, and is valid OpenAPI 3.1."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from aiohttp import web

from strata.engine.api import create_app
from strata.engine.api.openapi import openapi_document
from strata.engine.api.routes import setup_routes

_METHODS = ("get", "post", "put", "patch", "delete")


def _registered_operations() -> set[tuple[str, str]]:
    app = web.Application()
    setup_routes(app)
    operations = set()
    for route in app.router.routes():
        if route.method == "HEAD":  # aiohttp adds HEAD to every GET by itself
            continue
        # aiohttp's '{model:.+}' is OpenAPI's '{model}'
        path = re.sub(r"\{(\w+):[^}]*\}", r"{\1}", route.resource.canonical)
        operations.add((route.method.lower(), path))
    return operations


def _documented_operations() -> set[tuple[str, str]]:
    paths = openapi_document()["paths"]
    return {(method, path) for path, item in paths.items() for method in item if method in _METHODS}


def test_every_registered_route_is_documented():
    missing = _registered_operations() - _documented_operations()
    assert not missing, f"routes missing from strata/engine/api/openapi.py: {sorted(missing)}"


def test_every_documented_route_is_registered():
    extra = _documented_operations() - _registered_operations()
    assert not extra, f"openapi.py documents routes the app lacks: {sorted(extra)}"


def test_document_is_valid_openapi_31():
    validator = pytest.importorskip(
        "openapi_spec_validator", reason="pip install openapi-spec-validator to check the document")
    document = openapi_document("http://127.0.0.1:8080")
    assert document["openapi"] == "3.1.0"
    validator.validate(document)


def test_path_parameters_are_declared():
    for path, item in openapi_document()["paths"].items():
        names = set(re.findall(r"\{(\w+)\}", path))
        for method, op in item.items():
            declared = {p["name"] for p in op.get("parameters", ()) if p["in"] == "path"}
            assert declared == names, f"{method.upper()} {path}: path parameters {declared}"


async def test_served_at_openapi_json_with_the_request_host(aiohttp_client):
    # The route reads only the server's slot count (--slots) from the service.
    client = await aiohttp_client(create_app(SimpleNamespace(num_slots=6)))
    response = await client.get("/openapi.json")
    assert response.status == 200
    document = await response.json()
    assert document["servers"] == [{"url": f"http://{client.host}:{client.port}"}]
    slot_param = document["paths"]["/slots/{slot_id}"]["post"]["parameters"][0]
    assert slot_param["schema"]["maximum"] == 5
    assert "/v1/chat/completions" in document["paths"]
