"""An engine process driven over its pipe by a test, one command at a time: spawned with the
real process loop (core/process.py), past its Ready, then `ask` per command."""

from __future__ import annotations

import multiprocessing

from strata.engine import protocol as p
from strata.engine.core.process import engine_main

CTX = multiprocessing.get_context("spawn")


class EnginePipe:
    def __init__(self, factory: str, config, timeout_s: float = 60.0) -> None:
        self.config = config
        self.timeout_s = timeout_s  # how long recv waits for any event
        self.conn, child = CTX.Pipe()
        self.process = CTX.Process(target=engine_main, args=(child, factory, config), daemon=True)
        self.process.start()
        child.close()
        self.next_id = 0
        assert isinstance(self.recv(), p.Ready)

    def recv(self):
        assert self.conn.poll(self.timeout_s), "the engine process answered nothing"
        return self.conn.recv()

    def ask(self, command):
        """Send command; its answer (events of other commands on the way are dropped)."""
        self.next_id += 1
        self.conn.send(p.Envelope(self.next_id, command))
        while True:
            event = self.recv()
            if getattr(event, "command_id", None) == self.next_id:
                return event

    def close(self) -> None:
        self.process.kill()
        self.process.join(10)
