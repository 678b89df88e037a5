"""The engine process loop (core/process.py) through a real spawned process and raw pipe."""

from __future__ import annotations

import multiprocessing

import pytest
from fakes.fake_engine import FAKE_ENGINE_FACTORY, RAISE_TOKEN, FakeEngineConfig, expected_tokens

from strata.engine import protocol as p
from strata.engine.core.process import engine_main

pytestmark = pytest.mark.timeout(60)
CTX = multiprocessing.get_context("spawn")


class RawEngine:
    """A spawned engine process driven over the pipe by hand, one envelope at a time."""

    def __init__(self, config: FakeEngineConfig, factory: str = FAKE_ENGINE_FACTORY):
        self.conn, child = CTX.Pipe()
        self.process = CTX.Process(target=engine_main, args=(child, factory, config), daemon=True)
        self.process.start()
        child.close()
        self.next_id = 0

    def send(self, command) -> int:
        self.next_id += 1
        self.conn.send(p.Envelope(self.next_id, command))
        return self.next_id

    def recv(self, timeout_s: float = 10.0):
        assert self.conn.poll(timeout_s), "the engine process answered nothing"
        return self.conn.recv()

    def until_final(self, request_id: str) -> list:
        events = []
        while not events or not isinstance(events[-1], (p.Done, p.Error)):
            event = self.recv()
            if getattr(event, "request_id", None) == request_id:
                events.append(event)
        return events


def tokens_of(events) -> list[int]:
    return [t for e in events if isinstance(e, p.Tokens) for t in e.token_ids]


def test_process_serves_commands_in_order_and_survives_failures():
    engine = RawEngine(FakeEngineConfig(token_delay_s=0.02))
    try:
        ready = engine.recv()
        assert isinstance(ready, p.Ready) and ready.pid == engine.process.pid
        assert ready.version == p.PROTOCOL_VERSION

        cid = engine.send(p.GetStatus())
        status = engine.recv()
        assert (status.engine.state, status.command_id) == ("standby", cid)

        engine.send(p.Generate("early", (1, 2), p.SamplingSpec(max_tokens=3)))
        error = engine.recv()
        assert (error.code, error.request_id) == ("not_loaded", "early")

        engine.conn.send("not an envelope")
        assert engine.recv().code == "bad_request"
        cid = engine.send(p.Sleep())
        refused = engine.recv()
        assert (refused.code, refused.command_id) == ("not_applicable", cid)

        cid = engine.send(p.Load(model_path="fake-model", device="cpu"))
        reply = engine.recv()
        assert isinstance(reply, p.Reply) and reply.command_id == cid
        assert reply.result["model_type"] == "fake"

        # A generation streams every token and ends with Done(usage).
        engine.send(p.Generate("a", (5, 6, 7), p.SamplingSpec(max_tokens=6)))
        events = engine.until_final("a")
        assert tokens_of(events) == expected_tokens((5, 6, 7), 6)
        assert events[-1].usage == p.Usage(3, 6, 0, "length")

        # During a generation, GetStatus is answered at once and a Load waits for its end.
        engine.send(p.Generate("b", (5, 6, 7, 8), p.SamplingSpec(max_tokens=20)))
        load_id = engine.send(p.Load(model_path="fake-model", device="cpu"))
        status_id = engine.send(p.GetStatus())
        order = []
        while len(order) < 3:
            event = engine.recv()
            if isinstance(event, p.Status):
                order.append(("status", event.command_id, event.engine.state))
            elif isinstance(event, p.Reply):
                order.append(("reply", event.command_id))
            elif isinstance(event, p.Done):
                order.append(("done", event.usage.finish_reason, event.usage.cached_tokens))
        assert order == [("status", status_id, "loaded"), ("done", "length", 3), ("reply", load_id)]

        # An exception inside the engine answers Error(internal) and the loop goes on.
        engine.send(p.Generate("boom", (RAISE_TOKEN, 1), p.SamplingSpec(max_tokens=5)))
        events = engine.until_final("boom")
        assert events[-1].code == "internal" and "fake engine failure" in events[-1].message

        # Cancel mid-stream: the generator is closed and Done says cancelled.
        engine.send(p.Generate("c", (9,), p.SamplingSpec(max_tokens=1000)))
        first = engine.recv()
        assert isinstance(first, p.Tokens) and first.request_id == "c"
        engine.send(p.Cancel("c"))
        events = engine.until_final("c")
        assert events[-1].usage.finish_reason == "cancelled"
        assert 1 <= events[-1].usage.completion_tokens < 1000

        cid = engine.send(p.Unload())
        assert engine.recv() == p.Reply(cid, {"unloaded": True, "kept_slots": []})
        engine.process.join(10)
        assert engine.process.exitcode == 0
    finally:
        engine.process.kill()


def test_a_factory_that_cannot_be_imported_fails_the_load_not_the_process():
    engine = RawEngine(FakeEngineConfig(), factory="no_such_module_xyz:Engine")
    try:
        assert isinstance(engine.recv(), p.Ready)
        cid = engine.send(p.Load(model_path="fake-model"))
        error = engine.recv()
        assert (error.code, error.command_id) == ("internal", cid)
        assert "no_such_module_xyz" in error.message
        engine.send(p.GetStatus())
        assert engine.recv().engine.state == "standby"  # still serving
    finally:
        engine.process.kill()


def test_a_refusal_is_one_log_line_and_a_bug_keeps_its_traceback(capfd, tmp_path):
    oom_file = tmp_path / "no-vram"
    oom_file.touch()
    engine = RawEngine(FakeEngineConfig(oom_file=str(oom_file)))
    try:
        assert isinstance(engine.recv(), p.Ready)
        engine.send(p.Load("fake-model"))
        refused = engine.recv()
        assert (refused.code, type(refused)) == ("out_of_memory", p.Error)  # VRAM is short
        oom_file.unlink()
        engine.send(p.Load("fake-model"))
        assert isinstance(engine.recv(), p.Reply)
        engine.send(p.ReleaseExperts())  # a dense fake: not applicable
        assert engine.recv().code == "not_applicable"
        engine.send(p.Generate("bug", (1, RAISE_TOKEN), p.SamplingSpec(max_tokens=3)))
        engine.until_final("bug")
        engine.send(p.Unload())
        engine.process.join(10)
    finally:
        if engine.process.is_alive():
            engine.process.kill()
    err = capfd.readouterr().err
    assert "Load refused (out_of_memory)" in err and "ReleaseExperts refused (not_applicable)" in err
    assert "FakeOutOfMemory" not in err and "FakeNotApplicable" not in err  # no traceback
    assert "Traceback" in err and "RuntimeError: fake engine failure" in err  # a bug keeps it


def test_generation_streams_where_select_cannot_poll_pipes(monkeypatch):
    """Windows' select() takes sockets only (WinError 10038 on a pipe): tokens still stream."""
    import select
    import threading

    from strata.engine.core import process, process_pipe

    def windows_select(*args):
        raise OSError(10038, "An operation was attempted on something that is not a socket")

    monkeypatch.setattr(select, "select", windows_select)
    monkeypatch.setattr(process_pipe, "_can_select_pipes", True)  # as if first tried on Windows
    host, child = CTX.Pipe()
    loop = process.EngineLoop(child, FAKE_ENGINE_FACTORY, FakeEngineConfig())
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    try:
        assert isinstance(host.recv(), p.Ready)
        host.send(p.Envelope(1, p.Load(model_path="fake-model", device="cpu")))
        assert isinstance(host.recv(), p.Reply)
        host.send(p.Envelope(2, p.Generate("w", (5, 6, 7), p.SamplingSpec(max_tokens=6))))
        events = []
        while not events or not isinstance(events[-1], (p.Done, p.Error)):
            assert host.poll(10), "the engine loop answered nothing"
            events.append(host.recv())
        assert tokens_of(events) == expected_tokens((5, 6, 7), 6)
        assert events[-1].usage == p.Usage(3, 6, 0, "length")
        assert process_pipe._can_select_pipes is False  # tried once, then never again
        host.send(p.Envelope(3, p.Unload()))
        assert host.recv() == p.Reply(3, {"unloaded": True, "kept_slots": []})
        thread.join(10)
        assert not thread.is_alive()
    finally:
        host.close()
