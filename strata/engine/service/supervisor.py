"""Owns the engine process: spawn, handshake, load, per-request event streams, crash restarts.

Everything here runs on the service's asyncio loop except one reader thread per engine process
(see `_read_events` for why a thread). States: unloaded | starting | loaded | failed.

After an unload, a standby process (engine module and torch imported, no model, no CUDA
context) can wait behind the one that exited, so the next load skips seconds of imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

from strata.engine import protocol as p
from strata.engine.core.process import DEFAULT_ENGINE_FACTORY, engine_main
from strata.engine.service.engine_handle import (
    EngineCommandError,
    EngineHandle,
    EngineUnavailable,
    call_soon,
    describe_exit,
    failure_message,
)

__all__ = ["EngineCommandError", "EngineUnavailable", "Supervisor", "describe_exit"]

log = logging.getLogger(__name__)

OUT_OF_MEMORY_RETRY_S = 5.0  # Retry-After of a load the engine refused for want of VRAM


class Supervisor:
    """Starts, watches and restarts the engine process, and routes its events."""

    def __init__(
        self,
        engine_config: Any,
        factory: str = DEFAULT_ENGINE_FACTORY,
        *,
        ready_timeout_s: float = 60.0,
        load_timeout_s: float = 900.0,
        command_timeout_s: float = 60.0,
        cancel_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 60.0,
    ):
        self.engine_config = engine_config
        self.factory = factory
        self.ready_timeout_s = ready_timeout_s
        self.load_timeout_s = load_timeout_s
        self.command_timeout_s = command_timeout_s
        self.cancel_timeout_s = cancel_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.state = "unloaded"
        self.last_error: str | None = None
        self.load_info: dict[str, Any] | None = None
        self.num_starts = 0
        self.num_crashes = 0  # unexpected exits and failed starts, over the lifetime
        self.num_out_of_memory = 0  # loads the engine refused for want of VRAM: no crash
        self.num_consecutive_failures = 0  # reset by a finished generation
        self.state_listeners: list[Callable[[str], None]] = []
        self._retry_at_s = 0.0  # time.monotonic() before which no restart is tried
        self._handle: EngineHandle | None = None
        self._standby: EngineHandle | None = None  # spawned, no model: the next load uses it
        self._command_ids = itertools.count(1)
        self._bring_up_lock = asyncio.Lock()
        self.last_exit_code: int | None = None  # of the last model-holding engine process
        self._stop_requested = False  # stop() came while starting: the failure is no crash
        self._context = multiprocessing.get_context("spawn")  # fork would copy CUDA/threads

    # ---- state -----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._handle.pid if self._handle and self._handle.is_alive else None

    @property
    def standby_pid(self) -> int | None:
        standby = self._standby
        return standby.pid if standby and standby.is_alive else None

    @property
    def retry_in_s(self) -> float:
        return max(0.0, self._retry_at_s - time.monotonic())

    def _set_state(self, state: str) -> None:
        if state == self.state:
            return
        self.state = state
        for listener in list(self.state_listeners):
            try:
                listener(state)
            except Exception:
                log.exception("a state listener failed")

    def _register_failure(self, message: str) -> None:
        """Record a crash or failed start; repeated ones back off 1 s, 2 s, 4 s ... capped."""
        self.num_crashes += 1
        self.num_consecutive_failures += 1
        self.last_error = message
        self.load_info = None
        # The first failure restarts at once (a one-off fault should cost one request, not
        # a wait); only repeated ones wait.
        n = self.num_consecutive_failures
        delay_s = 0.0 if n == 1 else min(self.backoff_base_s * 2 ** (n - 2), self.backoff_max_s)
        self._retry_at_s = time.monotonic() + delay_s
        log.warning("engine failure %d: %s (next start allowed in %.1f s)", n, message, delay_s)
        self._set_state("failed")

    def status(self) -> dict[str, Any]:
        """The supervisor's view: state, pid, last error, restart counters, backoff."""
        return {
            "state": self.state,
            "pid": self.pid,
            "standby_pid": self.standby_pid,
            "last_error": self.last_error,
            "num_starts": self.num_starts,
            "num_crashes": self.num_crashes,
            "retry_in_s": round(self.retry_in_s, 3) if self.state == "failed" else 0.0,
            "engine": dict(self.load_info) if self.load_info else None,
        }

    # ---- bring up / stop -------------------------------------------------------------------

    async def ensure_loaded(self) -> dict[str, Any]:
        """Start the engine process and load the model unless that is done; returns load info.

        Raises EngineUnavailable with the reason (and retry_after_s while backing off).
        """
        async with self._bring_up_lock:
            handle = self._handle
            if self.state == "loaded" and handle is not None and handle.is_alive:
                return dict(self.load_info or {})
            wait_s = self.retry_in_s
            if wait_s > 0:
                raise EngineUnavailable(
                    f"the engine failed ({self.last_error}); it restarts in {wait_s:.1f} s, "
                    "retry then or check the log",
                    retry_after_s=wait_s,
                )
            self._set_state("starting")
            handle = None
            try:
                await self._shut_down(self._handle, self.stop_timeout_s)  # a leftover one
                handle = self._take_standby() or await self._start_process()
                await self._wait_ready(handle)
                reply = await self._command(handle, self._load_command(), self.load_timeout_s)
            except (EngineCommandError, EngineUnavailable, TimeoutError, OSError) as exc:
                message = failure_message(exc, self.load_timeout_s)
                await self._shut_down(handle, self.stop_timeout_s)
                if self._stop_requested:
                    self._stop_requested = False
                    self._set_state("unloaded")
                    raise EngineUnavailable("the engine was stopped while it was starting") from None
                if isinstance(exc, EngineCommandError) and exc.code == "out_of_memory":
                    # Another program holds the VRAM: nothing crashed, the next try can work.
                    self.num_out_of_memory += 1
                    self._set_state("unloaded")
                    log.info("load refused, VRAM is short: %s", exc)
                    raise EngineUnavailable(message, retry_after_s=OUT_OF_MEMORY_RETRY_S,
                                            is_out_of_memory=True) from None
                self._register_failure(message)
                raise EngineUnavailable(message, retry_after_s=self.retry_in_s or None) from None
            self.load_info = dict(reply.result)
            self.last_error = None
            self._set_state("loaded")
            return dict(self.load_info)

    def _load_command(self) -> p.Load:
        config = self.engine_config
        return p.Load(
            model_path=str(getattr(config, "model_path", "")),
            context_tokens=int(getattr(config, "context_tokens", 0)),
            device=str(getattr(config, "device", "auto")),
        )

    def _take_standby(self) -> EngineHandle | None:
        """The standby process as the engine handle, if one is alive (it may not be Ready yet)."""
        standby, self._standby = self._standby, None
        if standby is None or not standby.is_alive:
            return None
        self._handle = standby
        log.info("loading into the standby engine process %d", standby.pid)
        return standby

    async def start_standby(self) -> int | None:
        """Spawn a process that waits, without a model, for the next load; returns its pid.

        Returns at once (the process imports the engine in the background); does nothing when
        an engine or standby process already runs.
        """
        if self._standby is not None and self._standby.is_alive:
            return self._standby.pid
        if self._handle is not None and self._handle.is_alive:
            return None
        self._standby = await self._spawn()
        return self._standby.pid

    async def standby_status(self) -> p.Status | None:
        """The standby process's own Status (what it has imported), or None without one."""
        standby = self._standby
        if standby is None or not standby.is_alive:
            return None
        await self._wait_ready(standby)
        return await self._command(standby, p.GetStatus(), self.command_timeout_s)

    async def stop_standby(self, timeout_s: float | None = None) -> None:
        """End the standby process, if any (the host is shutting down)."""
        standby, self._standby = self._standby, None
        await self._shut_down(standby, self.stop_timeout_s if timeout_s is None else timeout_s)

    async def _start_process(self) -> EngineHandle:
        handle = await self._spawn()
        self._handle = handle
        return handle

    async def _spawn(self) -> EngineHandle:
        loop = asyncio.get_running_loop()
        parent_conn, child_conn = self._context.Pipe(duplex=True)
        # daemon: if the host dies without stop(), multiprocessing's exit hook ends the engine
        # instead of joining it forever.
        process = self._context.Process(
            target=engine_main, args=(child_conn, self.factory, self.engine_config),
            name="strata-engine", daemon=True,
        )
        if _can_ignore_sigint():
            _start_ignoring_sigint(process)  # on this (main) thread: only it may set handlers
        else:  # start() pickles the config and writes spawn data; keep that off the loop
            await loop.run_in_executor(None, process.start)
        child_conn.close()  # else the EOF that tells us the child died would never come
        self.num_starts += 1
        handle = EngineHandle(process=process, conn=parent_conn, ready=loop.create_future())
        # A stop during start-up leaves nobody awaiting Ready; its error is expected then.
        handle.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        threading.Thread(
            target=self._read_events, args=(handle, loop),
            name=f"strata-engine-reader-{handle.pid}", daemon=True,
        ).start()
        return handle

    async def _wait_ready(self, handle: EngineHandle) -> None:
        try:
            ready = await asyncio.wait_for(asyncio.shield(handle.ready), self.ready_timeout_s)
        except TimeoutError:
            raise EngineUnavailable(
                f"the engine process did not start within {self.ready_timeout_s:.0f} s"
            ) from None
        if ready.version != p.PROTOCOL_VERSION:
            raise EngineUnavailable(
                f"the engine speaks protocol {ready.version}, the host {p.PROTOCOL_VERSION}; "
                "reinstall Strata"
            )

    async def stop(self, timeout_s: float | None = None,
                   keep_sessions_as: str | None = None) -> list[int]:
        """End the engine process: cancel streams, Unload, join; terminate, then kill if stuck.

        keep_sessions_as: the engine writes every slot's history to that file name ("{slot}"
        in it) once its VRAM is free; returns the slots it kept."""
        if timeout_s is None:
            timeout_s = self.stop_timeout_s
        if self.state == "starting":
            self._stop_requested = True
            # A load in flight holds nothing to save, and the engine would answer Unload only
            # after the load: end the process now (Ctrl-C during a load stops at once).
            timeout_s = 0.0
        kept = await self._shut_down(self._handle, timeout_s, keep_sessions_as)
        self.load_info = None
        if self.state != "failed" or self.retry_in_s == 0:  # failed stays visible while backing off
            self._set_state("unloaded")
        return kept

    async def _shut_down(self, handle: EngineHandle | None, timeout_s: float,
                         keep_sessions_as: str | None = None) -> list[int]:
        kept: list[int] = []
        if handle is None:
            return kept
        was_current = handle is self._handle
        handle.is_exit_expected = True
        if handle.is_alive:
            for request_id in list(handle.streams):
                self._try_send(handle, p.Cancel(request_id))
            try:
                reply = await self._command(handle, p.Unload(keep_sessions_as), timeout_s)
                kept = list(getattr(reply, "result", {}).get("kept_slots") or [])
            except (EngineCommandError, TimeoutError):
                pass  # dead or stuck: the join below ends it either way
        loop = asyncio.get_running_loop()
        process = handle.process
        await loop.run_in_executor(None, process.join, timeout_s)
        if process.exitcode is None:
            if timeout_s > 0:  # 0: a stop during a load, which terminates on purpose
                log.warning("engine process %d did not exit after Unload; terminating",
                            handle.pid)
            process.terminate()
            await loop.run_in_executor(None, process.join, 1.0)
        if process.exitcode is None:
            process.kill()
            await loop.run_in_executor(None, process.join, 1.0)
        try:
            await asyncio.wait_for(handle.exited.wait(), 2.0)  # the reader has reported
        except TimeoutError:
            log.warning("engine reader of pid %d did not report the exit", handle.pid)
        if self._handle is handle:
            self._handle = None
        # This path and the reader both join the process: the one that loses the race to reap
        # it reads no exit code (multiprocessing's poll meets ECHILD), so the reader may have
        # reported None for a clean exit (run 37). Both joins are over now.
        if was_current and process.exitcode is not None:
            self.last_exit_code = process.exitcode
        return kept

    def kill(self, reason: str) -> None:
        """Kill the engine at once (it is stuck); its requests fail and the next one restarts."""
        handle = self._handle
        if handle is not None and handle.is_alive:
            handle.kill_reason = reason
            handle.process.kill()

    # ---- commands and streams --------------------------------------------------------------

    def _try_send(self, handle: EngineHandle, command: Any) -> bool:
        try:
            self._send(handle, command)
            return True
        except EngineCommandError:
            return False

    def _send(self, handle: EngineHandle, command: Any, command_id: int | None = None) -> int:
        command_id = next(self._command_ids) if command_id is None else command_id
        if not handle.is_alive:
            raise EngineCommandError("engine_crashed", "the engine process is not running")
        try:
            handle.conn.send(p.Envelope(command_id, command))
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise EngineCommandError("engine_crashed", f"the engine process is gone ({exc})") from None
        return command_id

    async def _command(self, handle: EngineHandle, command: Any, timeout_s: float) -> Any:
        command_id = next(self._command_ids)
        waiter = asyncio.get_running_loop().create_future()
        handle.waiters[command_id] = waiter
        try:
            self._send(handle, command, command_id)
            event = await asyncio.wait_for(waiter, timeout_s)
        finally:
            handle.waiters.pop(command_id, None)
        if isinstance(event, p.Error):
            raise EngineCommandError(event.code, event.message)
        return event

    async def command(self, command: Any, timeout_s: float | None = None) -> Any:
        """Send a control command to the running engine and return its Reply or Status.

        Never starts the engine: raises EngineCommandError("not_running") when it is down.
        A command that runs past its timeout means a wedged engine (every later command would
        queue behind it): the process is killed, so it restarts, and EngineCommandError
        ("engine_timeout") is raised. A GetStatus while a generation or another command runs is
        exempt: it waits behind that work (a long prefill step, a sleep writing snapshots),
        which has its own timeout.
        """
        handle = self._handle
        if handle is None or not handle.is_alive:
            raise EngineCommandError("not_running", "the engine is not running; load it first")
        timeout_s = timeout_s or self.command_timeout_s
        try:
            return await self._command(handle, command, timeout_s)
        except TimeoutError:
            name = type(command).__name__
            if isinstance(command, p.GetStatus) and (handle.streams or handle.waiters):
                raise
            reason = f"did not answer {name} within {timeout_s:g} s"
            log.error("engine process %d %s; killing it to restart", handle.pid, reason)
            if self._handle is handle:
                self.kill(reason)
                # Seen as failed (and restarting) before the caller answers its client.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(handle.exited.wait(), self.stop_timeout_s)
            raise EngineCommandError(
                "engine_timeout", f"the engine {reason}; it is restarting, retry shortly"
            ) from None

    async def stream(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: p.SamplingSpec,
        slot: int | None = None,
        on_end: Callable[[p.Done | p.Error | None], None] | None = None,
    ) -> AsyncGenerator[p.Tokens | p.Done | p.Error | p.PromptProgress, None]:
        """Run one Generate and yield its events, ending with Done or Error.

        Closing the iterator early sends Cancel and waits (cancel_timeout_s) for the engine's
        Done, so the next request finds the engine idle; a stuck engine is killed instead.
        `on_end` gets the final event (None if none came).
        """
        command = p.Generate(request_id, tuple(prompt_ids), sampling, slot)
        async with contextlib.aclosing(self.request(command, on_end)) as events:
            async for event in events:
                yield event

    async def embed(self, request_id: str, token_ids: tuple[tuple[int, ...], ...],
                    pooling: str) -> AsyncGenerator[p.Embeddings | p.Done | p.Error, None]:
        """Run one Embed and yield its Embeddings in order, ending with Done or Error; closing
        the iterator early cancels it, as `stream` does a Generate."""
        async with contextlib.aclosing(self.request(p.Embed(request_id, token_ids,
                                                            pooling))) as events:
            async for event in events:
                yield event

    async def request(
        self,
        command: p.Generate | p.Embed,
        on_end: Callable[[p.Done | p.Error | None], None] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """Send a request command and yield the events of its request_id up to its Done or
        Error; closing early sends Cancel and waits for the engine's Done (see `stream`)."""
        request_id = command.request_id
        handle = self._handle
        if handle is None or not handle.is_alive:
            raise EngineUnavailable("the engine is not running")
        queue: asyncio.Queue = asyncio.Queue()
        handle.streams[request_id] = queue
        final: p.Done | p.Error | None = None
        try:
            try:
                self._send(handle, command)
            except EngineCommandError as exc:
                queue.put_nowait(p.Error(exc.code, str(exc), request_id=request_id))
            while True:
                event = await queue.get()
                if isinstance(event, (p.Done, p.Error)):
                    final = event
                yield event
                if final is not None:
                    return
        finally:
            try:
                if final is None:
                    final = await self._cancel_and_wait(handle, request_id, queue)
            finally:
                handle.streams.pop(request_id, None)
                if on_end is not None:
                    on_end(final)

    async def _cancel_and_wait(
        self, handle: EngineHandle, request_id: str, queue: asyncio.Queue
    ) -> p.Done | p.Error | None:
        if not handle.is_alive and queue.empty():
            return None
        self._try_send(handle, p.Cancel(request_id))
        try:
            async with asyncio.timeout(self.cancel_timeout_s):
                while True:
                    event = await queue.get()
                    if isinstance(event, (p.Done, p.Error)):
                        return event
        except TimeoutError:
            reason = f"did not stop within {self.cancel_timeout_s:.0f} s of a cancel"
            log.error("engine process %d %s; killing it", handle.pid, reason)
            if self._handle is handle:
                self.kill(reason)
            return p.Error("engine_crashed", f"the engine {reason}", request_id=request_id)

    # ---- events from the engine ------------------------------------------------------------

    def _read_events(self, handle: EngineHandle, loop: asyncio.AbstractEventLoop) -> None:
        """Reader thread: blocking recv, each event handed to the loop.

        A thread rather than loop.add_reader: Connection.recv() blocks until a whole message is
        there, so on the loop a large message split across reads would stall every request;
        here EOF (the process died) is seen at once, and joining the corpse to learn its exit
        code cannot block the loop either.
        """
        while True:
            try:
                event = handle.conn.recv()
            except (EOFError, OSError):
                break
            except Exception:
                log.exception("unreadable message from engine %d; dropping the engine", handle.pid)
                handle.process.kill()
                break
            if not call_soon(loop, self._dispatch, handle, event):
                return
        handle.process.join(1.0)  # EOF comes at exit, the exit code a moment later
        handle.conn.close()
        call_soon(loop, self._on_exit, handle, handle.process.exitcode)

    def _dispatch(self, handle: EngineHandle, event: Any) -> None:
        if isinstance(event, p.Ready):
            if not handle.ready.done():
                handle.ready.set_result(event)
            return
        request_id = getattr(event, "request_id", None)
        if request_id is not None:
            queue = handle.streams.get(request_id)
            if queue is not None:
                queue.put_nowait(event)
            if isinstance(event, p.Done):
                self.num_consecutive_failures = 0  # a finished generation: the engine works
            return
        command_id = getattr(event, "command_id", None)
        waiter = handle.waiters.get(command_id) if command_id is not None else None
        if waiter is not None and not waiter.done():
            waiter.set_result(event)
        elif isinstance(event, p.Error):
            log.error("engine error (%s): %s", event.code, event.message)

    def _on_exit(self, handle: EngineHandle, exit_code: int | None) -> None:
        handle.is_alive = False
        if handle is self._handle:
            self.last_exit_code = exit_code  # 0 after a clean Unload; an abort is a bug
        reason = handle.kill_reason or describe_exit(exit_code)
        message = f"the engine process (pid {handle.pid}) {reason}"
        if not handle.ready.done():
            handle.ready.set_exception(EngineUnavailable(f"{message} before it was ready"))
        for waiter in handle.waiters.values():
            if not waiter.done():
                waiter.set_exception(EngineCommandError("engine_crashed", message))
        for request_id, queue in handle.streams.items():
            queue.put_nowait(p.Error("engine_crashed", message, request_id=request_id))
        handle.exited.set()
        if self._standby is handle:
            self._standby = None
            if not handle.is_exit_expected:
                log.warning("the standby engine process %s; the next load starts a new one", reason)
        if self._handle is handle:
            self._handle = None
            # While starting, ensure_loaded sees the failed Ready/Load and records it itself.
            if not handle.is_exit_expected and self.state == "loaded":
                self._register_failure(message)
            elif handle.is_exit_expected and self.state == "loaded":
                self.load_info = None
                self._set_state("unloaded")


def _can_ignore_sigint() -> bool:
    return hasattr(signal, "SIGINT") and os.name == "posix" and (
        threading.current_thread() is threading.main_thread())


def _start_ignoring_sigint(process: multiprocessing.process.BaseProcess) -> None:
    """process.start() with SIGINT ignored for the moment of the spawn: the child inherits an
    ignored SIGINT through exec (a blocked one it does not keep) and Python leaves it ignored,
    so a terminal's Ctrl-C, which reaches the whole process group, cannot kill the engine while
    it starts; the host alone decides when the engine stops (`strata serve` under Ctrl-C)."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process.start()
    finally:
        signal.signal(signal.SIGINT, previous)
