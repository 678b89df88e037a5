"""Lifecycle: the levels of DESIGN §4 (release experts, offload session, sleep, unload), the gate
that generations and level changes share, and the state they leave.

The admission gate (admission.py) lets up to `parallel` generations run at once and makes level
changes run alone, FIFO: a request that arrives during a level change waits for it and then
runs. Going down while a request runs or waits is refused (409), except shrink_experts, which
resizes the expert cache between the running streams' tokens; coming back waits its turn
(lifecycle_return.py: hook and VRAM guard first). The idle timers (lifecycle_idle.py) fire
through the gate too.

The engine's own typed status (protocol.EngineStatus, carried by every level reply) is the only
record of the levels: nothing here keeps a flag beside it. Status reads only read what the last
level change or request left behind: nothing wakes the model or restarts an idle clock because
someone looked. Listeners hear every change of state (state_listeners), so no one polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from strata.engine import protocol as p
from strata.engine.service import levels as lv
from strata.engine.service import status_schema as schema
from strata.engine.service.admission import AdmissionGate
from strata.engine.service.before_load import BeforeLoadHook
from strata.engine.service.expert_shrink import GROW_INTERVAL_S, ExpertShrinker, cache_info
from strata.engine.service.facade import ServiceError
from strata.engine.service.levels import Action, Level, Levels, State
from strata.engine.service.lifecycle_idle import IDLE_TIMERS, IdleTimers
from strata.engine.service.lifecycle_return import KEPT_SLOT_FILE, ComingBack, engine_level_error
from strata.engine.service.supervisor import EngineCommandError, Supervisor
from strata.engine.service.vram_guard import VramGuard
from strata.units import MIB

log = logging.getLogger(__name__)

__all__ = ["IDLE_TIMERS", "Lifecycle"]
STATUS_TIMEOUT_S = 10.0
RESTART_RETRY_MIN_S = 1.0  # between restart attempts that failed without a backoff (hook, VRAM)


class Lifecycle(ComingBack):
    """Levels, the gate they share with generations, and the idle timers, over a Supervisor."""

    def __init__(
        self,
        supervisor: Supervisor,
        idle_timeouts_s: dict[str, float | None],
        *,
        guard: VramGuard,
        hook: BeforeLoadHook,
        keep_standby: bool = True,
        on_change: Any = None,
        parallel: int = 1,
        max_queue: int = 64,
    ):
        """idle_timeouts_s: countdown key (cache_release, ...) -> seconds, None = off.
        on_change(action, ok, cause=None): called after each level change (cause: why, when
        the lifecycle went down by itself, e.g. "idle for 300 s"), for counters and listeners.
        parallel: generations sent to the engine at once; max_queue: how many more may wait."""
        self.supervisor = supervisor
        self.guard = guard
        self.hook = hook
        self.keep_standby = keep_standby
        self._on_change = on_change or (lambda action, ok, cause=None: None)
        # Called (on the loop, no arguments) whenever the state, the levels or the activity
        # may have changed: the tray re-reads status() then instead of polling it.
        self.state_listeners: list[Callable[[], None]] = []
        self.gate = AdmissionGate(parallel, max_queue, on_change=self._notify)
        self._bring_back_lock = asyncio.Lock()  # requests that arrive together come back once
        self.transition: str | None = None  # loading | waking while coming back
        self.engine: p.EngineStatus | None = None  # the engine's last status, typed
        self.last_error: str | None = None
        self.timers = IdleTimers(idle_timeouts_s, is_paused=self._is_paused, is_up=self.is_up,
                                 levels=self.levels, fire=self._fire_idle)
        # Set while a step back up is refused for want of VRAM: a state, not a failure.
        self.waiting_for_vram: dict[str, Any] | None = None
        self._vram_wait_s: float | None = None  # this action's guard wait (None: configured)
        self._kept_slots: list[int] = []  # saved before a rule's unload, restored after load
        self._load_need_bytes: int | None = None
        self.shrinker = ExpertShrinker(guard.read_free_bytes)
        self._resize_lock = asyncio.Lock()  # one shrink or grow at a time, live or not
        self._grow_task: asyncio.Task | None = None
        # A loaded engine that crashed (or was killed for a timeout) comes back by itself.
        self._restart_task: asyncio.Task | None = None
        self._supervisor_state = supervisor.state
        supervisor.state_listeners.append(self._on_supervisor_state)

    # ---- reading ---------------------------------------------------------------------------

    @property
    def is_busy(self) -> bool:
        """A request runs or waits for the gate."""
        return self.gate.is_busy

    @property
    def num_running(self) -> int:
        return self.gate.num_running

    @property
    def num_waiting(self) -> int:
        return self.gate.num_waiting

    @property
    def active_request_id(self) -> str | None:
        """The generation running longest, or None."""
        return self.gate.oldest_request_id

    def _is_paused(self) -> bool:
        """The idle clocks wait: a request or a step back up is under way."""
        return self.is_busy or self.transition is not None

    def is_up(self) -> bool:
        return self.supervisor.state == "loaded" and self.supervisor.pid is not None

    def _engine_now(self) -> p.EngineStatus | None:
        """The engine's last status, if it is of the process running now."""
        engine = self.engine
        if not self.is_up() or engine is None or engine.pid != self.supervisor.pid:
            return None
        return engine

    def levels(self) -> Levels:
        """Each part's level, read from the engine's own last status."""
        engine = self._engine_now()
        return lv.levels_of(engine) if engine is not None else lv.NOT_LOADED

    def state(self) -> State:
        """The service's one State."""
        if self.transition:
            return State.WAITING_FOR_VRAM if self.guard.waiting else State(self.transition)
        supervisor_state = self.supervisor.state
        if self.waiting_for_vram is not None and supervisor_state != "loaded":
            return State.WAITING_FOR_VRAM
        if supervisor_state == "starting":
            return State.LOADING
        if supervisor_state in ("failed", "unloaded"):
            return State(supervisor_state)
        if self.active_request_id is not None:
            return State.BUSY
        return lv.idle_state(self.levels())

    def vram(self) -> dict[str, schema.ArenaBytes]:
        """Bytes per arena as the engine last reported them; {} while nothing is loaded."""
        return lv.vram_by_arena(self._engine_now())

    def idle_countdowns(self) -> dict[str, float | None]:
        """Seconds until each idle timer fires; None when off, not applicable or reached."""
        return self.timers.countdowns()

    def idle_fired(self) -> dict[str, float]:
        """Timers that fired in this idle period: seconds since each fired."""
        return self.timers.fired()

    # ---- lifetime --------------------------------------------------------------------------

    def start_timers(self) -> None:
        self.timers.start()

    def set_idle_timeout(self, key: str, seconds: float | None) -> None:
        """Change one idle timer (cache_release, ..., unload) at run time; None turns it off."""
        self.timers.set_timeout(key, seconds)
        self._notify()

    async def stop(self) -> None:
        """Stop the timers and end the engine and standby processes."""
        if self._grow_task is not None:
            self._grow_task.cancel()
        if self._restart_task is not None:
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restart_task
            self._restart_task = None
        await self.timers.stop()
        await self.supervisor.stop()
        await self.supervisor.stop_standby()

    # ---- requests --------------------------------------------------------------------------

    async def begin_request(self, request_id: str) -> None:
        """Wait for a place at the gate, then bring back what a generation needs (load, wake,
        refill).

        Raises ServiceError (503 queue_full, or the place released) when that fails;
        otherwise the caller must call end_request(request_id) when the generation is over.
        """
        await self.gate.admit(request_id)
        try:
            async with self._bring_back_lock:
                await self._bring_back(need_experts=True)
        except BaseException:
            self.gate.release(request_id)
            self._mark_activity()
            raise

    async def end_request(self, request_id: str) -> None:
        """The generation is over: refresh the cached status, restart the idle clock."""
        try:
            await self._refresh()  # the engine restored an offloaded session to generate
        finally:
            self.gate.release(request_id)
            self._mark_activity()

    # ---- actions ---------------------------------------------------------------------------

    async def level_action(self, action: Action, *, vram_wait_s: float | None = None,
                           keep_sessions: bool = False,
                           keep_free_mib: int | None = None) -> dict[str, Any]:
        """Run a level action; returns {action, freed_bytes, changed, ...}.

        vram_wait_s: how long the guard waits for VRAM on the way up (None: --vram-wait; a
        rule's restore passes 0 and retries itself). keep_sessions: an unload saves the
        slots' sessions first and the next load restores them (a rule's unload).
        keep_free_mib: shrink_experts' target of free VRAM.

        shrink_experts runs beside running generations (the engine resizes between their
        tokens, issue 54); the other levels down wait for none (409)."""
        if action is Action.SHRINK_EXPERTS and self.gate.num_running:
            return await self._shrink_live(keep_free_mib or 0)
        if action.is_down and self.is_busy:
            raise ServiceError("busy", f"{self.num_running} requests run and "
                               f"{self.num_waiting} wait; {action.replace('_', ' ')} again when "
                               "they have finished")
        before = self._engine_now()
        async with self.gate.exclusive():
            self._vram_wait_s = vram_wait_s
            try:
                if action is Action.UNLOAD:
                    result = await self._unload(keep_sessions=keep_sessions)
                elif action is Action.SHRINK_EXPERTS:
                    async with self._resize_lock:
                        result = await self._shrink(keep_free_mib or 0)
                elif action.is_down:
                    result = await self._go_down(action)
                else:
                    result = await self._go_up(action)
            except ServiceError as exc:
                if exc.code == "insufficient_vram":  # waiting for VRAM is a state, not an error
                    self.waiting_for_vram = self.waiting_for_vram or {
                        "what": action.replace("_", " "), "reason": exc.message}
                else:
                    self.last_error = exc.message
                self._on_change(action, False)
                raise
            finally:
                self._vram_wait_s = None
                self._notify()
        if result.get("changed"):
            self.last_error = None
            self._on_change(action, True)
        return {"action": action, "freed_bytes": lv.freed_bytes(before, self._engine_now()),
                **result}

    async def slot_action(self, action: str, command: Any) -> dict[str, Any]:
        """SaveSlot / RestoreSlot / EraseSlot on the engine, bringing the weights back first."""
        async with self.gate.exclusive():
            await self._bring_back(need_experts=False)
            try:
                reply = await self.supervisor.command(command)
            except EngineCommandError as exc:
                raise engine_level_error(action, exc) from None
            self._keep_status(reply)
            self._mark_activity()
        return dict(reply.result)

    async def read_forwards(self) -> p.ForwardCounts | None:
        """The engine's forward counts now (GetStatus), None without an engine or a count."""
        if self.supervisor.pid is None:
            return None
        with contextlib.suppress(EngineCommandError, TimeoutError):
            self.engine = (await self.supervisor.command(p.GetStatus(), STATUS_TIMEOUT_S)).engine
        return self.engine.forwards if self.engine is not None else None

    async def read_slots(self) -> list[schema.SlotStatus] | None:
        """The engine's slots now (GetStatus is answered even mid-generation), else the cache."""
        engine = self.engine
        if self.supervisor.pid is not None:
            with contextlib.suppress(EngineCommandError, TimeoutError):
                engine = (await self.supervisor.command(p.GetStatus(), STATUS_TIMEOUT_S)).engine
        if engine is None or engine.state is p.EngineState.STANDBY:
            return None
        return [slot_row(slot) for slot in engine.slots]

    async def _go_down(self, action: Action) -> dict[str, Any]:
        if not self.is_up():
            return {"changed": False, "reason": "no model is loaded"}
        if action in (Action.RELEASE_EXPERTS, Action.SLEEP):
            self.shrinker.clear()  # the whole cache goes: nothing to grow back into
        if lv.is_level_reached(action, self.levels()) and not (
                action is Action.RELEASE_EXPERTS and self.levels().experts == Level.NONE):
            return {"changed": False, "reason": "already there"}
        # "none" experts still asks the engine: its not_applicable answer says why (dense).
        result = await self._engine_level(action)
        return {"changed": True, "result": result}

    async def _go_up(self, action: Action) -> dict[str, Any]:
        before = (self.state(), self.levels())
        if action is Action.LOAD:
            await self._bring_back(need_experts=True)
        elif not self.is_up():
            return {"changed": False, "reason": "no model is loaded; load brings it back"}
        elif action is Action.WAKE:
            await self._bring_back(need_experts=True)
        elif action is Action.REFILL_EXPERTS:
            if self.levels().weights == Level.SLEEPING:
                return {"changed": False, "reason": "the model sleeps; wake brings it back"}
            if self.levels().experts == Level.RESIDENT and not self._is_shrunk():
                return {"changed": False, "reason": "the experts are resident"}
            self.shrinker.clear()
            await self._come_back(Action.REFILL_EXPERTS, "refill the experts")
            return {"changed": True}  # released, or shrunk: every slot is back either way
        else:  # restore_session
            await self._bring_back(need_experts=False)
            result = await self._engine_level(action)
            self._mark_activity()
            return {"changed": True, "result": result}
        return {"changed": before != (self.state(), self.levels())}

    async def _shrink_live(self, keep_free_mib: int) -> dict[str, Any]:
        """shrink_experts while generations run: outside the gate (which would wait for them
        to end), one resize at a time; the streams go on at the new size."""
        before = self._engine_now()
        async with self._resize_lock:
            try:
                result = await self._shrink(keep_free_mib)
            except ServiceError as exc:
                self.last_error = exc.message
                self._on_change(Action.SHRINK_EXPERTS, False)
                raise
            finally:
                self._notify()
        if result.get("changed"):
            self.last_error = None
            self._on_change(Action.SHRINK_EXPERTS, True)
        return {"action": Action.SHRINK_EXPERTS,
                "freed_bytes": lv.freed_bytes(before, self._engine_now()), **result}

    def _is_shrunk(self) -> bool:
        cache = cache_info(self.engine.experts if self.engine is not None else None)
        return cache is not None and cache["num_slots"] < cache["max_slots"]

    async def _shrink(self, keep_free_mib: int) -> dict[str, Any]:
        """shrink_experts: fewer expert slots until keep_free_mib MiB are free; serving goes
        on from the partial cache, and a grower task maps slots back as VRAM frees."""
        if not self.is_up():
            return {"changed": False, "reason": "no model is loaded"}
        if self.levels().weights == Level.SLEEPING or self.levels().experts == Level.RELEASED:
            return {"changed": False, "reason": "the expert cache is not resident"}
        await self._refresh()
        try:
            result = await self.shrinker.shrink(
                self._command, self.engine.experts if self.engine else None, keep_free_mib * MIB)
        except EngineCommandError as exc:
            raise engine_level_error(Action.SHRINK_EXPERTS, exc) from None
        if self.shrinker.keep_free_bytes is not None and self._grow_task is None:
            self._grow_task = asyncio.create_task(self._grow(), name="strata-expert-grower")
        return result

    async def _grow(self) -> None:
        """Map expert slots back while a shrink target is set and VRAM allows."""
        try:
            while self.shrinker.keep_free_bytes is not None:
                await asyncio.sleep(GROW_INTERVAL_S)
                if self.transition or not self.is_up():
                    continue
                if self.gate.num_running:  # streams decode: grow between their tokens
                    guard: Any = contextlib.nullcontext()
                elif self.gate.is_in_use:  # a level change runs or waits
                    continue
                else:
                    guard = self.gate.exclusive()
                async with guard, self._resize_lock:
                    experts = self.engine.experts if self.engine is not None else None
                    if await self.shrinker.grow_step(self._command, experts):
                        self.shrinker.clear()
                self._notify()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not take the lifecycle down
            log.exception("the expert grower failed")
        finally:
            self._grow_task = None

    async def _unload(self, keep_sessions: bool = False) -> dict[str, Any]:
        supervisor = self.supervisor
        self.shrinker.clear()
        was_running = supervisor.pid is not None or supervisor.state != "unloaded"
        restart = self._restart_task
        if restart is not None and restart is not asyncio.current_task():
            restart.cancel()  # unloaded on purpose: no restart after an earlier crash
        # A rule's unload keeps the conversations: the engine writes them to files once its
        # VRAM is back (the game must not wait for the disk), and the next load restores them.
        kept = await supervisor.stop(keep_sessions_as=KEPT_SLOT_FILE if keep_sessions else None)
        if keep_sessions:
            self._kept_slots = list(kept)
        self.engine = None
        standby_pid = await supervisor.start_standby() if self.keep_standby else None
        return {"changed": was_running, "standby_pid": standby_pid}

    # ---- restarts after a crash ------------------------------------------------------------

    def _on_supervisor_state(self, state: str) -> None:
        """A loaded engine that fails (crash, OOM kill, killed for a timeout) is restarted
        now, with the supervisor's backoff, so /health recovers without waiting for a client."""
        was_loaded, self._supervisor_state = self._supervisor_state == "loaded", state
        self._notify()
        if state != "failed" or not was_loaded:
            return
        if self._restart_task is None or self._restart_task.done():
            self._restart_task = asyncio.get_running_loop().create_task(
                self._restart_after_crash(), name="strata-engine-restart")

    async def _restart_after_crash(self) -> None:
        supervisor = self.supervisor
        while supervisor.state == "failed":
            await asyncio.sleep(supervisor.retry_in_s)
            async with self.gate.exclusive():
                if supervisor.state != "failed":
                    return  # a request brought it back, or it was unloaded
                log.info("restarting the engine after: %s", supervisor.last_error)
                try:
                    await self._load()
                    return
                except ServiceError as exc:
                    log.warning("the engine did not restart: %s", exc.message)
                except Exception:  # a bug here must not end the restarts
                    log.exception("restarting the engine failed")
            if supervisor.retry_in_s == 0:
                await asyncio.sleep(RESTART_RETRY_MIN_S)

    # ---- idle timers -----------------------------------------------------------------------

    async def _fire_idle(self, action: Action, cause: str, is_stale: Callable[[], bool]) -> None:
        """An idle timer is due: go down, unless a request came while it waited for the gate."""
        async with self.gate.exclusive():
            if self.is_busy or is_stale():
                return  # a request came while we waited: its end restarted the clock
            log.info("%s: %s", cause, action.replace("_", " "))
            try:
                if action is Action.UNLOAD:
                    await self._unload()
                else:
                    await self._go_down(action)
                self._on_change(action, True, cause)
            except ServiceError as exc:
                if exc.code != "not_applicable":
                    self.last_error = exc.message
                    self._on_change(action, False, cause)
                    log.warning("idle %s failed: %s", action, exc.message)
                raise
            finally:
                self._notify()

    def _mark_activity(self) -> None:
        """A request ended or the model came back: every idle clock starts again."""
        self.timers.mark_activity()
        self._notify()

    def _notify(self) -> None:
        """Wake the idle timers and tell the state listeners: something may have changed."""
        self.timers.changed.set()
        for listener in list(self.state_listeners):
            try:
                listener()
            except Exception:  # a listener's bug must not fail the lifecycle
                log.exception("state listener failed")

    # ---- engine ----------------------------------------------------------------------------

    async def _command(self, command: Any) -> p.Reply:
        """A level command; the engine status its reply carries becomes the status."""
        reply = await self.supervisor.command(command)
        self._keep_status(reply)
        return reply

    def _keep_status(self, reply: Any) -> None:
        if isinstance(reply, p.Reply) and reply.engine is not None:
            self.engine = reply.engine

    async def _engine_level(self, action: Action) -> dict[str, Any]:
        try:
            reply = await self._command(action.command())
        except EngineCommandError as exc:
            raise engine_level_error(action, exc) from None
        except TimeoutError:
            raise ServiceError("engine_timeout", f"the engine did not answer {action.replace('_', ' ')} "
                f"within {self.supervisor.command_timeout_s:.0f} s; see the log and retry"
            ) from None
        return dict(reply.result)

    async def _refresh(self) -> None:
        """Ask the engine for its status (after a generation, a load); level commands need
        not: their replies carry it."""
        if self.supervisor.pid is None:
            self.engine = None
            return
        try:
            status = await self.supervisor.command(p.GetStatus(), STATUS_TIMEOUT_S)
        except (EngineCommandError, TimeoutError) as exc:
            log.debug("engine status not refreshed: %s", exc)
            return
        self.engine = status.engine


def slot_row(slot: p.SlotStatus) -> schema.SlotStatus:
    """A slot as /v1/status and the slots action show it."""
    return schema.SlotStatus(id=slot.id, n_tokens=slot.n_tokens, location=slot.location,
                             bytes=slot.bytes, is_processing=slot.is_processing,
                             n_ctx=slot.n_ctx, is_running=slot.is_running)
