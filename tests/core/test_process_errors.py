"""The engine log: one line for a client's error, a traceback only for a bug (issue 17 item 15).

A real engine process (the real Engine on a tiny llama) driven over its pipe; its stderr is the
test's, captured at the file-descriptor level.
"""

from __future__ import annotations

import multiprocessing

import pytest

from strata.engine import protocol as p
from strata.engine.core.engine import EngineConfig
from strata.engine.core.process import DEFAULT_ENGINE_FACTORY, engine_main
from tests.snapshots.helpers import save_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
CTX = multiprocessing.get_context("spawn")


def test_client_errors_log_one_line_and_bugs_a_traceback(tmp_path, capfd) -> None:
    model_dir = save_tiny_llama(tmp_path / "model", seed=0)
    config = EngineConfig(model_path=str(model_dir), device="cpu", context_tokens=256,
                          snapshot_dir=str(tmp_path / "snapshots"))
    conn, child = CTX.Pipe()
    process = CTX.Process(target=engine_main, args=(child, DEFAULT_ENGINE_FACTORY, config),
                          daemon=True)
    process.start()
    child.close()
    answers = {}

    def ask(command_id: int, command) -> p.Event:
        conn.send(p.Envelope(command_id, command))
        while True:
            assert conn.poll(60), "the engine process answered nothing"
            event = conn.recv()
            if getattr(event, "command_id", None) == command_id or isinstance(event, p.Error):
                return event

    try:
        assert isinstance(conn.recv(), p.Ready)
        assert isinstance(ask(1, p.Load(str(model_dir), 256, "cpu")), p.Reply)
        capfd.readouterr()
        answers["empty"] = ask(2, p.SaveSlot(0, "chat.bin"))  # slot 0 holds nothing yet
        answers["dense"] = ask(3, p.ReleaseExperts())  # a dense model has no expert cache
        answers["missing"] = ask(4, p.RestoreSlot(1, "nope.bin"))
        client_log = capfd.readouterr().err
        # A bug: a Generate whose sampling is not a SamplingSpec fails inside the engine.
        answers["bug"] = ask(5, p.Generate("r1", (1, 2, 3), None, 0))  # type: ignore[arg-type]
        bug_log = capfd.readouterr().err
        conn.send(p.Envelope(6, p.Unload()))
    finally:
        process.join(30)
        if process.exitcode is None:
            process.kill()
    codes = {name: event.code for name, event in answers.items()}
    assert codes == {"empty": "bad_request", "dense": "not_applicable",
                     "missing": "bad_request", "bug": "internal"}
    assert "Traceback" not in client_log
    assert "slot 0 is empty" in client_log and "ReleaseExperts refused (not_applicable)" in client_log
    assert len([line for line in client_log.splitlines() if "refused" in line]) == 3
    assert "Traceback (most recent call last)" in bug_log
