"""The engine process: reads typed commands from the pipe, runs the Engine, writes events.

The Supervisor (engine/service/supervisor.py) spawns `engine_main`. Generations share one
continuous batch: each Generate joins the engine's scheduler (add), and while any request runs
or waits the loop alternates between reading what arrived (without blocking) and one engine
step, sending each request's Tokens and its Done. Cancel, GetStatus and ResizeExperts (the expert
cache follows a shrunk or grown budget at the next token, without a reload) are answered
between steps; every other command (levels, slots, load) waits in a queue until the batch drains, and
Generates that arrive after such a command wait behind it. An Embed is a request too: it joins
as a Generate does and runs a few sequences per loop turn (core/embedding.py EmbedJob), beside
the batch's steps, so a chat decodes while it runs and a Cancel ends it between turns. A failing
command answers an Error and the loop goes on; only Unload, or the host closing the pipe, ends
the process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

from strata.engine import protocol as p
from strata.engine.core.error_codes import CommandRefused, error_code, one_line
from strata.engine.core.memory.heap_trim import trim_heap
from strata.engine.core.process_pipe import HostGone, HostPipe
from strata.engine.core.process_standby import Standby
from strata.logs import setup_logging
from strata.paths import kernel_cache_dir

# OpenMP threads that spin while waiting burn the cores a game or another server needs, and
# make decode 10-20x slower when the CPU is shared; set before torch is imported here.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The engine compiles its prefill kernels at load (20 s of a 47 s load on an H200 host with
# an empty cache); kept in Strata's cache instead of /tmp, later loads find them compiled.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(kernel_cache_dir() / "inductor"))
# Triton's compiled kernels (Strata's own and inductor's) and its autotune picks
# (kernels/launch.py: cache_results) go beside them, so they share one cache's lifetime with
# the tuning results (fast/tuning_store.py) rather than ~/.triton's. A user's setting wins.
os.environ.setdefault("TRITON_CACHE_DIR", str(kernel_cache_dir() / "triton"))

DEFAULT_ENGINE_FACTORY = "strata.engine.core.engine:Engine"
# How long the loop waits for a command before it runs a step of a load's deferred work
# (engine.has_deferred_work): a request sent right after the Load reply runs first.
DEFERRED_WORK_IDLE_S = 0.25

# Commands answered by an engine method of this name when the engine has one (lifecycle work
# adds them); an engine without it answers not_applicable.
_LEVEL_METHODS: dict[type, str] = {
    p.ReleaseExperts: "release_experts",
    p.RefillExperts: "refill_experts",
    p.ResizeExperts: "resize_experts",
    p.OffloadSession: "offload_session",
    p.RestoreSession: "restore_session",
    p.Sleep: "sleep",
    p.Wake: "wake",
    p.SaveSlot: "save_slot",
    p.RestoreSlot: "restore_slot",
    p.EraseSlot: "erase_slot",
}

log = logging.getLogger("strata.engine.process")

# Commands that start a request (request_id; Tokens/Embeddings, then Done or Error) rather than
# a control command answered by one Reply.
_REQUESTS = (p.Generate, p.Embed)


class EngineLoop:
    """The command loop of one engine process; `run()` returns when the process should exit."""

    def __init__(self, conn: Connection, factory: str, config: Any):
        self.pipe = HostPipe(conn)
        self.standby = Standby(factory)
        self.config = config
        self.engine: Any = None
        self.load_info: dict[str, Any] | None = None
        self.pending: deque[p.Envelope] = deque()  # commands waiting for the batch to drain
        self.embeds: dict[str, Any] = {}  # request id -> EmbedJob, run first come first
        # Per request: tokens (and their logprob records) made while the pipe was full.
        self.unsent: dict[str, tuple[list[int], list[p.TokenLogprob]]] = {}
        self._last_command_s = 0.0  # monotonic; status reads do not count (deferred work)
        self._worked_since_trim = False  # requests ran since the heap was last trimmed

    # ---- main loop -------------------------------------------------------------------------

    def run(self) -> None:
        self.pipe.send(p.Ready(pid=os.getpid()))
        self.standby.start(self.config)  # the engine module, then a load's imports on a thread
        while True:
            if self._is_batch_running() or self.embeds:
                self._worked_since_trim = True
                self._read_during_batch()
                if self._is_batch_running():
                    self._step()
                if self.embeds:
                    self._embed_step()
            elif self.pending:
                if not self.handle(self.pending.popleft()):
                    return
            elif self._has_deferred_work():
                # What the load left for later runs a step at a time once no command but a
                # status read has come for a moment, so a request right after the load runs
                # first, and a client polling the status often does not hold the work off.
                idle_s = time.monotonic() - self._last_command_s
                if self.pipe.poll(max(0.0, DEFERRED_WORK_IDLE_S - idle_s)):
                    if not self.handle(self.pipe.recv()):
                        return
                elif self.standby.is_warming:  # compiling needs the compiler imported
                    self.pipe.poll(DEFERRED_WORK_IDLE_S)
                else:
                    self._run_deferred_step()
            else:
                self._trim_after_work()
                if not self.handle(self.pipe.recv()):
                    return

    def _trim_after_work(self) -> None:
        """Going idle after requests ran: the heap's free pages back to the OS (heap_trim.py),
        so one long prompt's activations do not stay resident while nothing runs."""
        if self._worked_since_trim:
            self._worked_since_trim = False
            trim_heap()

    def _has_deferred_work(self) -> bool:
        return bool(getattr(self.engine, "has_deferred_work", False))

    def _run_deferred_step(self) -> None:
        """One step of the engine's idle work (the load's deferred compiles, a grown expert
        cache's fill); a failing step ends that work with a log line (the engine keeps
        serving as it did: eager prefill groups, slots filled by decode's misses)."""
        try:
            name = self.engine.run_deferred_step()
        except Exception:  # never fail the process for an optimisation
            log.warning("idle work failed and stops; the engine serves as it did",
                        exc_info=True)
            return
        log.debug("idle work: %s", name)

    def _is_batch_running(self) -> bool:
        return self.engine is not None and self.engine.has_work

    def _read_during_batch(self) -> None:
        """Take in what arrived since the last step, without waiting: Cancel and GetStatus at
        once, Generates (and Embeds) and ResizeExperts unless a command waits before them,
        the rest waits."""
        while self.pending and isinstance(getattr(self.pending[0], "command", None),
                                          _REQUESTS):
            self.handle(self.pending.popleft())  # the command they waited behind has run
        while self.pipe.poll(0):
            envelope = self.pipe.recv()
            command = getattr(envelope, "command", None)
            is_now = isinstance(command, (p.Cancel, p.GetStatus)) or (
                isinstance(command, (*_REQUESTS, p.ResizeExperts)) and not self.pending)
            if is_now:
                self.handle(envelope)
            else:
                self.pending.append(envelope)

    def handle(self, envelope: Any) -> bool:
        """Run one command; False when the process should exit (after Unload)."""
        if not isinstance(envelope, p.Envelope):
            self.pipe.send(p.Error("bad_request", f"expected an Envelope, got {type(envelope).__name__}"))
            return True
        command, command_id = envelope.command, envelope.command_id
        if not isinstance(command, p.GetStatus):
            self._last_command_s = time.monotonic()
        if envelope.version != p.PROTOCOL_VERSION:
            self.pipe.send(p.Error(
                "version_mismatch",
                f"host speaks protocol {envelope.version}, engine {p.PROTOCOL_VERSION}; "
                "restart Strata so both come from one install",
                command_id=command_id,
            ))
            return True
        request_id = command.request_id if isinstance(command, _REQUESTS) else None
        try:
            if isinstance(command, p.Unload):
                kept = self._close_engine(for_exit=True, keep_sessions_as=command.keep_sessions_as)
                self.pipe.send(p.Reply(command_id, {"unloaded": True, "kept_slots": kept}))
                return False
            if isinstance(command, p.Generate):
                self.admit(command)
            elif isinstance(command, p.Cancel):
                self.cancel(command.request_id)
            elif isinstance(command, p.GetStatus):
                self.pipe.send(self.status_event(command_id))
            elif isinstance(command, p.Load):
                self.pipe.send(p.Reply(command_id, self.load(command), self.engine_status()))
            elif type(command) in _LEVEL_METHODS:
                self.pipe.send(self.level_command(command, command_id))
            elif isinstance(command, p.Embed):
                self.start_embed(command)
            else:
                self.pipe.send(p.Error(
                    "bad_request", f"unknown command {type(command).__name__}",
                    command_id=command_id,
                ))
        except HostGone:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of one command
            # The host gets a one-line Error and the loop goes on. The log gets a traceback
            # only for a bug (an unexpected exception); a client's error is one line.
            code = error_code(exc, command)
            if code == "internal":
                traceback.print_exc(file=sys.stderr)
            else:
                log.info("%s refused (%s): %s", type(command).__name__, code, one_line(exc))
            self.pipe.send(p.Error(code, one_line(exc), request_id=request_id, command_id=command_id))
        return True

    # ---- commands --------------------------------------------------------------------------

    def load(self, command: p.Load) -> dict[str, Any]:
        config = self._config_for(command)
        if self.engine is not None:
            if config == self.config:
                return dict(self.load_info or {})  # already loaded: loading is idempotent
            raise CommandRefused(
                "busy", f"{self.config.model_path} is loaded; unload it before loading another model"
            )
        factory = self.standby.factory()
        self.standby.stop_warming()
        engine = factory(config)
        info = engine.load()
        self.engine, self.config, self.load_info = engine, config, dict(info or {})
        return dict(self.load_info)

    def _config_for(self, command: p.Load) -> Any:
        """The engine config with the Load command's model, device and context applied."""
        changes = {
            name: getattr(command, name)
            for name in ("model_path", "device", "context_tokens")
            if hasattr(self.config, name)
        }
        if dataclasses.is_dataclass(self.config):
            return dataclasses.replace(self.config, **changes)
        return self.config

    def status_event(self, command_id: int | None) -> p.Status:
        return p.Status(self.engine_status(), command_id=command_id)

    def engine_status(self) -> p.EngineStatus:
        """The engine's status, typed once here for every host reader."""
        if self.engine is None:
            return p.EngineStatus(p.EngineState.STANDBY, os.getpid(),
                                  standby=self.standby.info())
        return p.EngineStatus.of_engine(self.engine.status(), os.getpid())

    def level_command(self, command: Any, command_id: int) -> p.Event:
        method = getattr(self.engine, _LEVEL_METHODS[type(command)], None)
        name = type(command).__name__
        if self.engine is None or method is None:
            reason = "no model is loaded" if self.engine is None else "this engine has no such level"
            return p.Error("not_applicable", f"{name} does not apply: {reason}", command_id=command_id)
        fields = {f.name: getattr(command, f.name) for f in dataclasses.fields(command)}
        result = dict(method(**fields) or {})
        return p.Reply(command_id, result, self.engine_status())

    def start_embed(self, command: p.Embed) -> None:
        """The Embed joins the loop's embedding jobs; one it cannot run answers an Error."""
        if self.engine is None:
            raise CommandRefused("not_loaded", "no model is loaded: send Load first")
        if command.request_id in self.embeds:
            raise CommandRefused("bad_request", f"request {command.request_id} already runs")
        from strata.engine.core.embedding import EmbedJob  # torch: imported in the engine only

        self.embeds[command.request_id] = EmbedJob(self.engine, command)

    def _embed_step(self) -> None:
        """One step of the oldest embedding: its next vectors, then Done when it is over."""
        job = next(iter(self.embeds.values()))
        try:
            event = job.step(self.engine)
        except Exception as exc:  # noqa: BLE001 - that request fails, the engine goes on
            del self.embeds[job.request_id]
            code = error_code(exc, job.command)
            if code == "internal":
                traceback.print_exc(file=sys.stderr)
            self.pipe.send(p.Error(code, one_line(exc), request_id=job.request_id))
            return
        self.pipe.send(event)
        if job.is_done:
            del self.embeds[job.request_id]
            self.pipe.send(p.Done(job.request_id, p.Usage(job.num_tokens, 0, 0, "stop")))

    # ---- the batch ---------------------------------------------------------------------------

    def admit(self, command: p.Generate) -> None:
        """The request joins the engine's batch; a request it refuses answers an Error."""
        if self.engine is None:
            self.pipe.send(p.Error("not_loaded", "no model is loaded: send Load first",
                              request_id=command.request_id))
            return
        self.engine.add(command.request_id, command.prompt_ids, command.sampling, command.slot)

    def cancel(self, request_id: str) -> None:
        """End a running or waiting request with Done(cancelled); a request that already
        ended owes no answer."""
        job = self.embeds.pop(request_id, None)
        if job is not None:
            self.pipe.send(p.Done(request_id, p.Usage(job.num_tokens, 0, 0, "cancelled")))
            return
        event = self.engine.cancel(request_id) if self.engine is not None else None
        if event is not None:
            self._send_event(event)
            return
        for envelope in list(self.pending):  # a Generate still queued behind a level command
            command = envelope.command
            if isinstance(command, _REQUESTS) and command.request_id == request_id:
                self.pending.remove(envelope)
                num_prompt = len(command.prompt_ids) if isinstance(command, p.Generate) else 0
                usage = p.Usage(num_prompt, 0, 0, "cancelled")
                self.pipe.send(p.Done(request_id, usage, slot=None))

    def _step(self) -> None:
        """One engine step; its tokens go out while the pipe takes them (else they ride along
        with the next send), each finished request gets its Done or Error."""
        try:
            events = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a bug in the step itself: every request fails
            traceback.print_exc(file=sys.stderr)
            failed = [e.request_id for e in self.engine.cancel_all()]
            for request_id in failed:
                self._flush(request_id)
                self.pipe.send(p.Error("internal", one_line(exc), request_id=request_id))
            return
        for event in events:
            self._send_event(event)
        if self.unsent and self.pipe.is_writable():
            for request_id in list(self.unsent):
                self._flush(request_id)

    def _send_event(self, event: Any) -> None:
        """A SequenceEvent (core/batch/events.py): buffer its tokens; at its end flush them
        and send Done, or Error when it failed; a prompt's progress goes out at once."""
        if event.progress is not None:
            self._flush(event.request_id)
            self.pipe.send(event.progress)
        if event.token_ids:
            tokens, logprobs = self.unsent.setdefault(event.request_id, ([], []))
            tokens.extend(event.token_ids)
            logprobs.extend(event.logprobs)
        if event.error is not None:
            self._flush(event.request_id)
            code = error_code(event.error, None)
            if code == "internal":
                traceback.print_exception(event.error, file=sys.stderr)
            else:
                log.info("Generate refused (%s): %s", code, one_line(event.error))
            self.pipe.send(p.Error(code, one_line(event.error), request_id=event.request_id))
        elif event.usage is not None:
            self._flush(event.request_id)
            self.pipe.send(p.Done(event.request_id, event.usage, slot=event.slot))

    def _flush(self, request_id: str) -> None:
        tokens, logprobs = self.unsent.pop(request_id, ((), ()))
        if tokens:
            self.pipe.send(p.Tokens(request_id, tuple(tokens), tuple(logprobs)))

    def _close_engine(self, for_exit: bool = False, keep_sessions_as: str | None = None,
                      ) -> list[int]:
        """Close the engine; for_exit: the process ends next, so the engine may take its
        fast path (close_for_exit: VRAM back at once, host memory left to the exit).
        Returns the slots kept as keep_sessions_as files."""
        if self.engine is None:
            return []
        engine, self.engine, self.load_info = self.engine, None, None
        close = getattr(engine, "close_for_exit", None) if for_exit else None
        if close is None:
            engine.close()
            return []
        # close_for_exit destroys the CUDA context: the engine's tensors must never be freed
        # after it (a pinned tensor's destructor records an event on the dead context and
        # torch calls terminate: issue 18's unload row), so they live until os._exit.
        _KEPT_UNTIL_EXIT.append(engine)
        kept = close(keep_sessions_as) if keep_sessions_as else close()
        return list(kept or [])


_KEPT_UNTIL_EXIT: list[Any] = []  # engines closed for exit: never garbage-collected


def use_engine_allocator() -> None:
    """torch's CUDA allocator as the engine process runs it; call before torch is imported
    (a benchmark that measures the engine's VRAM in its own process calls it too).

    The caching allocator keeps a whole segment while any block in it lives: small buffers
    left from a prefill held 390 MiB through a sleep (issue 18), and the 8B's load kept 225
    MiB free beside its scratch (issue 19). Expandable segments give back every page no live
    tensor uses. A user's own setting wins."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def engine_main(conn: Connection, factory: str = DEFAULT_ENGINE_FACTORY, config: Any = None) -> None:
    """Body of the spawned engine process: serve commands from `conn` until Unload or EOF.

    `factory` is "module:callable" building the engine from `config` (an EngineConfig, or the
    config type of a test engine). Sends Ready(pid) first.
    """
    # Ctrl-C in a terminal reaches the whole process group; the host decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    use_engine_allocator()
    setup_logging("engine", "engine: %(message)s")  # a rotating file where there is no stderr
    loop = EngineLoop(conn, factory, config)
    try:
        loop.run()
    except HostGone:
        log.info("the host closed the pipe; engine process exiting")
    finally:
        try:
            loop._close_engine(for_exit=True)
        except Exception:  # noqa: BLE001 - exiting anyway; keep the log
            traceback.print_exc(file=sys.stderr)
        conn.close()
    _exit_now()


def _exit_now() -> None:
    """End the process without the interpreter's shutdown. With torch and CUDA loaded that
    shutdown took 1-8 s on an H200 (atexit hooks, module teardown, allocator and context
    destructors) while the host waited; the engine has already written what must survive."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)
