"""Control routes: lifecycle levels (/load, /sleep, ...) and explicit slot save/restore/erase."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from strata.engine.api.errors import bad_request
from strata.engine.api.model_routing import service_of
from strata.engine.api.validation import get_int, parse_slot, read_json_object
from strata.engine.protocol import filename_problem

# Route path -> the service's action name.
LEVEL_ACTIONS = {
    "/load": "load", "/unload": "unload", "/sleep": "sleep", "/wake": "wake",
    "/cache/release": "release_experts", "/cache/refill": "refill_experts",
    "/session/offload": "offload_session",
}
_SLOT_ACTIONS = {"save": "slot_save", "restore": "slot_restore", "erase": "slot_erase"}


def _json(result: Any) -> web.Response:
    return web.json_response(result if isinstance(result, dict) else {"result": result})


async def level_action(request: web.Request) -> web.Response:
    """POST /load, /unload, /sleep, /wake, /cache/release, /cache/refill, /session/offload."""
    body = await read_json_object(request, allow_empty=True)  # a body, if any, is JSON
    resource = request.match_info.route.resource
    assert resource is not None  # routes.py adds this handler on a path: it has a resource
    unknown = sorted(set(body) - {"model"})
    if unknown:
        raise bad_request(f"unknown field(s) {', '.join(unknown)}; {resource.canonical} takes "
                          "only 'model' (absent: the default model)", param=unknown[0])
    action = LEVEL_ACTIONS[resource.canonical]
    service = service_of(request)  # the body's model (model_routing.py)
    return _json({**await service.control(action), "model": service.model_id})


async def shrink_experts(request: web.Request) -> web.Response:
    """POST /cache/shrink {"keep_free_mib": N}: fewer expert slots until N MiB are free."""
    body = await read_json_object(request)
    unknown = sorted(set(body) - {"keep_free_mib", "model"})
    if unknown:
        raise bad_request(f"unknown field(s) {', '.join(unknown)}; /cache/shrink takes "
                          "keep_free_mib (and model)", param=unknown[0])
    keep_free_mib = get_int(body, "keep_free_mib", None, minimum=0)
    if keep_free_mib is None:
        raise bad_request("'keep_free_mib' is required: the MiB of VRAM to keep free, an "
                          "integer >= 0", param="keep_free_mib")
    service = service_of(request)
    return _json(await service.control("shrink_experts", keep_free_mib=keep_free_mib))


def check_slot_filename(filename: Any) -> str:
    """A plain file name inside the snapshot directory (protocol.filename_problem), else 400."""
    if not isinstance(filename, str) or not filename:
        raise bad_request("'filename' must be a non-empty string", param="filename")
    if filename_problem(filename) is not None:
        raise bad_request(f"'filename' {filename[:80]!r} must be a plain file name (no '/', "
                          "'\\', '..', drive or NUL, at most 255 characters); slots are saved "
                          "inside the snapshot directory", param="filename")
    return filename


async def slot_action(request: web.Request) -> web.Response:
    """POST /slots/{id}?action=save|restore|erase with {"filename": ...} for save/restore;
    answers llama.cpp's payload (id_slot, filename, n_saved|n_restored|n_erased, ...)."""
    service = service_of(request)
    slot = parse_slot(request.match_info["slot_id"], "id_slot", service.num_slots)
    name = request.query.get("action", "")
    if name not in _SLOT_ACTIONS:
        raise bad_request(f"action {name[:20]!r} is unknown; use ?action=save, restore or erase",
                          param="action")
    body = await read_json_object(request, allow_empty=(name == "erase"))
    if name == "erase":
        answer = await service.control("slot_erase", slot=slot)
    else:
        filename = check_slot_filename(body.get("filename"))
        answer = await service.control(_SLOT_ACTIONS[name], slot=slot, filename=filename)
    # llama.cpp's payload at top level (id_slot, filename, n_saved, n_written, timings), which
    # its clients read; the service's status around it is for the tray.
    return web.json_response(answer["result"])
