"""Error codes come from the exception's `code` attribute or its type, never from its class
name (issue 21: codes were matched on names like "OutOfMemory"), and one table maps them to
HTTP for every route."""

from __future__ import annotations

import pytest

from strata.engine import protocol as p
from strata.engine.core.engine_errors import EngineBusy, EngineOutOfMemory, LevelNotApplicable
from strata.engine.core.error_codes import error_code
from strata.engine.core.memory.arena import ArenaMapError
from strata.engine.service.error_codes import CODES, http_status, level_error
from strata.errors import StrataError


def test_the_code_attribute_decides():
    assert error_code(LevelNotApplicable("dense"), p.ReleaseExperts()) == "not_applicable"
    assert error_code(EngineOutOfMemory("short"), p.Wake()) == "out_of_memory"
    assert error_code(EngineBusy("running"), p.Sleep()) == "busy"
    assert error_code(ArenaMapError("no room", "weights", 1 << 20), p.Load("m")) == \
        "out_of_memory"
    assert error_code(MemoryError(), p.Wake()) == "out_of_memory"
    assert error_code(StrataError("bad"), p.Sleep()) == "bad_request"
    assert error_code(StrataError("bad"), p.Load("m")) == "load_failed"
    assert error_code(RuntimeError("bug"), p.Sleep()) == "internal"


def test_torch_out_of_memory_is_out_of_memory_by_type():
    torch = pytest.importorskip("torch")
    assert error_code(torch.cuda.OutOfMemoryError("CUDA out of memory"), p.Wake()) == \
        "out_of_memory"


def test_a_class_name_alone_maps_to_nothing():
    # Look-alikes of the names the old mapping matched: without a code they are bugs.
    class SomeOutOfMemoryError(RuntimeError):
        pass

    class WeirdNotApplicable(RuntimeError):
        pass

    class StrataError(RuntimeError):  # the name, not the class
        pass

    class ArenaMapError(RuntimeError):
        pass

    for fake in (SomeOutOfMemoryError, WeirdNotApplicable, StrataError, ArenaMapError):
        assert error_code(fake("x"), p.Sleep()) == "internal", fake.__name__


def test_one_table_answers_every_route():
    for code, entry in CODES.items():
        assert http_status(code) == entry.status
        answer = level_error("sleep", code, "why")
        assert answer.status == http_status(answer.code), code
    assert http_status("no_such_code") == 500
    oom = level_error("wake", "out_of_memory", "3 MiB missing")
    assert (oom.status, oom.code, oom.retry_after_s) == (503, "insufficient_vram", 5.0)
    assert oom.message == ("wake failed, the GPU has too little free memory: 3 MiB missing; "
                           "close other GPU apps and retry")


def test_every_service_error_code_is_in_the_one_table() -> None:
    """issue 21 move 4: a ServiceError's HTTP status comes from error_codes.CODES; a code
    missing there would answer 500, so every code the host raises must be listed."""
    import ast
    from pathlib import Path

    from strata.engine.service.error_codes import CODES

    root = Path(__file__).resolve().parents[2] / "strata"
    raised = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ServiceError"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                raised.add(node.args[0].value)
    assert raised, "no ServiceError found: the scan is broken"
    assert raised <= set(CODES), sorted(raised - set(CODES))
