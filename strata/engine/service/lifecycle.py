"""Lifecycle: the levels of DESIGN §4 (release experts, offload session, sleep, unload), coming
back from them, and the idle timers that go down by themselves.

The admission gate (admission.py) lets up to `parallel` generations run at once and makes level
changes run alone, FIFO: a request that arrives during a level change waits for it and then
runs. Going down while a request runs or waits is refused (409); coming back waits its turn. Every step back up runs the before-load
hook (load, wake) and the free-VRAM guard (load, wake, refill) first, so a failure is a clean
ServiceError before any event, and the level stays where it was.

Status reads (state, levels, VRAM, countdowns) only read what the last level change or request
left behind: nothing here wakes the model or restarts an idle clock because someone looked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from strata.engine import protocol as p
from strata.engine.service import levels as lv
from strata.engine.service.admission import AdmissionGate
from strata.engine.service.before_load import BeforeLoadHook
from strata.engine.service.expert_shrink import GROW_INTERVAL_S, ExpertShrinker, cache_info
from strata.engine.service.facade import ServiceError
from strata.engine.service.load_size import COME_BACK_WORKSPACE_BYTES, load_bytes, released_bytes
from strata.engine.service.supervisor import EngineCommandError, EngineUnavailable, Supervisor
from strata.engine.service.vram_guard import VramGuard
from strata.units import MIB

log = logging.getLogger(__name__)

DOWN_ACTIONS = ("release_experts", "shrink_experts", "offload_session", "sleep", "unload")
UP_ACTIONS = ("load", "wake", "refill_experts", "restore_session")
ALIASES = {"refill": "refill_experts", "release": "release_experts", "offload": "offload_session"}
# (countdown key in status()["idle"], settings field, the action it fires), shallow to deep.
IDLE_TIMERS = (
    ("cache_release", "cache_release_idle_s", "release_experts"),
    ("session_offload", "session_offload_idle_s", "offload_session"),
    ("sleep", "sleep_idle_s", "sleep"),
    ("unload", "idle_unload_s", "unload"),
)
_COMMANDS = {
    "release_experts": p.ReleaseExperts, "refill_experts": p.RefillExperts,
    "offload_session": p.OffloadSession, "restore_session": p.RestoreSession,
    "sleep": p.Sleep, "wake": p.Wake,
}
STATUS_TIMEOUT_S = 10.0
KEPT_SLOT_FILE = "strata-kept-slot{slot}.snap"  # a rule's unload keeps the sessions here
# What each way back maps again, by arena (load_size.released_bytes).
_COME_BACK_ARENAS = {"wake": ("weights", "experts", "kv"), "refill_experts": ("experts",)}
RESTART_RETRY_MIN_S = 1.0  # between restart attempts that failed without a backoff (hook, VRAM)


class Lifecycle:
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
        self.idle_timeouts_s = {key: idle_timeouts_s.get(key) for key, _, _ in IDLE_TIMERS}
        self._on_change = on_change or (lambda action, ok, cause=None: None)
        self.gate = AdmissionGate(parallel, max_queue)
        self._bring_back_lock = asyncio.Lock()  # requests that arrive together come back once
        self.transition: str | None = None  # loading | waking while coming back
        self.engine_state: str | None = None  # the last engine Status: state and info
        self.engine_info: dict[str, Any] = {}
        self.last_error: str | None = None
        # What the host asked of the engine process it last loaded; the engine's own status
        # wins where it reports the level (arena states, slot locations).
        self._engine_pid: int | None = None
        self._is_sleeping = self._experts_released = self._session_offloaded = False
        self.idle_since_s: float | None = None  # monotonic end of the last activity
        self._idle_epoch = 0  # bumped by every activity: a timer fires once per idle period
        self._fired_s: dict[str, float] = {}  # timer key -> monotonic time it fired
        self._inapplicable: set[str] = set()  # timers the engine said do not apply, until load
        self._changed = asyncio.Event()
        self._timer_task: asyncio.Task | None = None
        # Set while a step back up is refused for want of VRAM: a state, not a failure.
        self.waiting_for_vram: dict[str, Any] | None = None
        self._vram_wait_s: float | None = None  # this action's guard wait (None: configured)
        self._kept_slots: list[int] = []  # saved before a rule's unload, restored after load
        self._load_need_bytes: int | None = None
        self.shrinker = ExpertShrinker(guard.read_free_bytes)
        self._grow_task: asyncio.Task | None = None
        self._is_stopping = False
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

    def is_up(self) -> bool:
        return self.supervisor.state == "loaded" and self.supervisor.pid is not None

    def levels(self) -> dict[str, str]:
        """{experts: resident|released|none, session: resident|offloaded|none,
        weights: resident|sleeping|unloaded}."""
        if not self.is_up():
            return dict(lv.NOT_LOADED)
        info = self.engine_info
        is_sleeping = self._is_sleeping or self.engine_state == "sleeping"
        return {
            "experts": lv.experts_level(info, is_sleeping=is_sleeping,
                                        is_released=self._experts_released),
            "session": lv.session_level(info, is_sleeping=is_sleeping,
                                        is_offloaded=self._session_offloaded),
            "weights": "sleeping" if is_sleeping else "resident",
        }

    def state(self) -> str:
        """One word of levels.STATES."""
        if self.transition:
            return "waiting_for_vram" if self.guard.waiting else self.transition
        supervisor_state = self.supervisor.state
        if self.waiting_for_vram is not None and supervisor_state != "loaded":
            return "waiting_for_vram"
        if supervisor_state == "starting":
            return "loading"
        if supervisor_state in ("failed", "unloaded"):
            return supervisor_state
        if self.active_request_id is not None:
            return "busy"
        return lv.state_word(self.levels())

    def vram(self) -> dict[str, dict[str, int]]:
        """Bytes per arena as the engine last reported them; {} while nothing is loaded."""
        return lv.vram_by_arena(self.engine_info) if self.is_up() else {}

    def _countdowns_s(self) -> dict[str, float | None]:
        levels, now_s = self.levels(), time.monotonic()
        countdowns: dict[str, float | None] = {}
        for key, _, action in IDLE_TIMERS:
            timeout_s = self.idle_timeouts_s[key]
            if (timeout_s is None or not self.is_up() or key in self._inapplicable
                    or key in self._fired_s or lv.is_level_reached(action, levels)):
                countdowns[key] = None
            elif self.is_busy or self.transition or self.idle_since_s is None:
                countdowns[key] = timeout_s  # the clock starts when the activity ends
            else:
                countdowns[key] = max(0.0, self.idle_since_s + timeout_s - now_s)
        return countdowns

    def idle_countdowns(self) -> dict[str, float | None]:
        """Seconds until each idle timer fires; None when off, not applicable or reached."""
        return {k: None if v is None else round(v, 3) for k, v in self._countdowns_s().items()}

    def idle_fired(self) -> dict[str, float]:
        """Timers that fired in this idle period: seconds since each fired. They run again
        once the next request (or load, wake) has ended."""
        now_s = time.monotonic()
        return {key: round(now_s - fired_s, 3) for key, fired_s in self._fired_s.items()}

    # ---- lifetime --------------------------------------------------------------------------

    def start_timers(self) -> None:
        if self._timer_task is None and any(v is not None for v in self.idle_timeouts_s.values()):
            self._timer_task = asyncio.create_task(self._run_timers(), name="strata-idle-timers")

    def set_idle_timeout(self, key: str, seconds: float | None) -> None:
        """Change one idle timer (cache_release, ..., unload) at run time; None turns it off."""
        if key not in self.idle_timeouts_s:
            raise ValueError(f"no idle timer {key!r}")
        self.idle_timeouts_s[key] = seconds
        self._fired_s.pop(key, None)
        self._changed.set()
        self.start_timers()

    async def stop(self) -> None:
        """Stop the timers and end the engine and standby processes."""
        if self._grow_task is not None:
            self._grow_task.cancel()
        if self._restart_task is not None:
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restart_task
            self._restart_task = None
        if self._timer_task is not None:
            # Python 3.11's wait_for swallows a cancel that lands as its inner wait completes
            # (an unload just set _changed; cpython#86296): the flag ends the loop regardless.
            self._is_stopping = True
            self._changed.set()
            self._timer_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer_task
            self._timer_task = None
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
        self._changed.set()
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
            self._session_offloaded = False  # the engine restored it to generate
            await self._refresh()
        finally:
            self.gate.release(request_id)
            self._mark_activity()

    # ---- actions ---------------------------------------------------------------------------

    async def level_action(self, action: str, *, vram_wait_s: float | None = None,
                           keep_sessions: bool = False,
                           keep_free_mib: int | None = None) -> dict[str, Any]:
        """Run a level action (DOWN_ACTIONS or UP_ACTIONS); returns {changed, freed_bytes, ...}.

        vram_wait_s: how long the guard waits for VRAM on the way up (None: --vram-wait; a
        rule's restore passes 0 and retries itself). keep_sessions: an unload saves the
        slots' sessions first and the next load restores them (a rule's unload).
        keep_free_mib: shrink_experts' target of free VRAM."""
        action = ALIASES.get(action, action)
        if action in DOWN_ACTIONS and self.is_busy:
            raise ServiceError(409, "busy", f"{self.num_running} requests run and "
                               f"{self.num_waiting} wait; {action.replace('_', ' ')} again when "
                               "they have finished")
        before_bytes = lv.resident_bytes(self.vram())
        async with self.gate.exclusive():
            self._vram_wait_s = vram_wait_s
            try:
                if action == "unload":
                    result = await self._unload(keep_sessions=keep_sessions)
                elif action == "shrink_experts":
                    result = await self._shrink(keep_free_mib or 0)
                elif action in DOWN_ACTIONS:
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
        if result.get("changed"):
            self.last_error = None
            self._on_change(action, True)
        freed_bytes = max(0, before_bytes - lv.resident_bytes(self.vram()))
        return {"action": action, "freed_bytes": freed_bytes, **result}

    async def slot_action(self, action: str, command: Any) -> dict[str, Any]:
        """SaveSlot / RestoreSlot / EraseSlot on the engine, bringing the weights back first."""
        async with self.gate.exclusive():
            await self._bring_back(need_experts=False)
            try:
                reply = await self.supervisor.command(command)
            except EngineCommandError as exc:
                raise lv.service_error(action, exc) from None
            await self._refresh()
            self._mark_activity()
        return dict(reply.result)

    async def read_slots(self) -> list[dict[str, Any]] | None:
        """The engine's slots now (GetStatus is answered even mid-generation), else the cache."""
        if self.supervisor.pid is not None:
            with contextlib.suppress(EngineCommandError, TimeoutError):
                status = await self.supervisor.command(p.GetStatus(), STATUS_TIMEOUT_S)
                if isinstance(status.info.get("slots"), list):
                    return list(status.info["slots"])
        slots = self.engine_info.get("slots")
        return list(slots) if isinstance(slots, list) else None

    async def _go_down(self, action: str) -> dict[str, Any]:
        if action == "unload":
            return await self._unload()
        if not self.is_up():
            return {"changed": False, "reason": "no model is loaded"}
        if action in ("release_experts", "sleep"):
            self.shrinker.clear()  # the whole cache goes: nothing to grow back into
        if lv.is_level_reached(action, self.levels()) and not (
                action == "release_experts" and self.levels()["experts"] == "none"):
            return {"changed": False, "reason": "already there"}
        # "none" experts still asks the engine: its not_applicable answer says why (dense).
        result = await self._engine_level(action)
        if action == "release_experts":
            self._experts_released = True
        elif action == "offload_session":
            self._session_offloaded = True
        else:
            self._is_sleeping = self._session_offloaded = True
        await self._refresh()
        self._changed.set()
        return {"changed": True, "result": result}

    async def _go_up(self, action: str) -> dict[str, Any]:
        before = (self.state(), self.levels())
        if action == "load":
            await self._bring_back(need_experts=True)
        elif not self.is_up():
            return {"changed": False, "reason": "no model is loaded; load brings it back"}
        elif action == "wake":
            await self._bring_back(need_experts=True)
        elif action == "refill_experts":
            if self.levels()["weights"] == "sleeping":
                return {"changed": False, "reason": "the model sleeps; wake brings it back"}
            if self.levels()["experts"] == "resident" and not self._is_shrunk():
                return {"changed": False, "reason": "the experts are resident"}
            self.shrinker.clear()
            await self._refill()
            return {"changed": True}  # released, or shrunk: every slot is back either way
        else:  # restore_session
            await self._bring_back(need_experts=False)
            result = await self._engine_level(action)
            self._session_offloaded = False
            await self._refresh()
            self._mark_activity()
            return {"changed": True, "result": result}
        return {"changed": before != (self.state(), self.levels())}

    # ---- coming back -----------------------------------------------------------------------

    async def _bring_back(self, *, need_experts: bool) -> None:
        if not self.is_up():
            await self._load()
        if self.levels()["weights"] == "sleeping":
            await self._wake()
        if need_experts and self.levels()["experts"] == "released":
            await self._refill()

    async def _load(self) -> None:
        supervisor = self.supervisor
        async with self._coming_back("loading"):
            # While the supervisor backs off after crashes, ensure_loaded refuses at once: no
            # point in running the hook or waiting for VRAM first.
            if not (supervisor.state == "failed" and supervisor.retry_in_s > 0):
                await self.hook.run("load")
                await self._wait_for_vram("load the model", self._load_bytes())
            try:
                await supervisor.ensure_loaded()
            except EngineUnavailable as exc:
                if exc.is_out_of_memory:  # the engine found too little VRAM: not a crash
                    if self.keep_standby:
                        await supervisor.start_standby()
                    self.waiting_for_vram = {"what": "load the model", "reason": str(exc)}
                    raise ServiceError(503, "insufficient_vram", f"cannot load the model yet: "
                                       f"{exc}; waiting for VRAM, retry later",
                                       retry_after_s=exc.retry_after_s) from None
                raise ServiceError(503, "engine_unavailable", str(exc),
                                   retry_after_s=exc.retry_after_s) from None
            if supervisor.pid != self._engine_pid:  # a new process: nothing released in it
                self._engine_pid = supervisor.pid
                self._is_sleeping = self._experts_released = self._session_offloaded = False
                self._inapplicable.clear()
            await self._restore_kept_slots()
            await self._refresh()

    @contextlib.asynccontextmanager
    async def _coming_back(self, transition: str):
        """Show the transition while a level comes back; record its error, or clear the last
        one and count the step as activity (idle timers start again from here)."""
        self.transition = transition
        self._changed.set()
        try:
            yield
        except ServiceError as exc:
            if exc.code == "insufficient_vram":
                self.waiting_for_vram = self.waiting_for_vram or {
                    "what": transition, "reason": exc.message}
            else:
                self.last_error = exc.message
            raise
        finally:
            self.transition = None
        self.last_error = None
        self.waiting_for_vram = None
        self._mark_activity()

    async def _wake(self) -> None:
        await self._come_back("wake", "wake the model")

    async def _refill(self) -> None:
        await self._come_back("refill_experts", "refill the experts")

    async def _come_back(self, action: str, what: str) -> None:
        async with self._coming_back("waking"):
            if action == "wake":
                await self.hook.run("wake")
            need_bytes = released_bytes(self.engine_info, _COME_BACK_ARENAS[action])
            await self._wait_for_vram(
                what, need_bytes + COME_BACK_WORKSPACE_BYTES if need_bytes else 0)
            await self._engine_level(action)
            if action == "wake":
                self._is_sleeping = False
            else:
                self._experts_released = False
            await self._refresh()

    def _load_bytes(self) -> int:
        """What a load maps (load_size.load_bytes), computed once per model."""
        if self._load_need_bytes is None:
            self._load_need_bytes = load_bytes(self.supervisor.engine_config)
        return self._load_need_bytes

    async def _wait_for_vram(self, what: str, need_bytes: int) -> None:
        """The guard, recording a refusal as the waiting_for_vram state."""
        try:
            await self.guard.wait_for_room(what, need_bytes, self._vram_wait_s)
        except ServiceError as exc:
            self.waiting_for_vram = {"what": what, "reason": exc.message}
            log.info("%s", exc.message)  # working as designed: one line, no traceback
            raise

    async def _keep_sessions(self) -> None:
        """Save every slot with a session to a file, so the next load restores it."""
        if self.supervisor.pid is None or self._is_sleeping or self.engine_state == "sleeping":
            return  # asleep, the KV is not mapped: the sessions live only in the snapshots
        await self._refresh()
        slots = self.engine_info.get("slots") or []
        for row in slots:
            slot, num_tokens = row.get("id"), int(row.get("n_tokens") or 0)
            if not isinstance(slot, int) or num_tokens <= 0:
                continue
            try:
                await self.supervisor.command(p.SaveSlot(slot, KEPT_SLOT_FILE.format(slot=slot)))
                self._kept_slots.append(slot)
            except (EngineCommandError, TimeoutError) as exc:
                log.warning("slot %d's session is not kept over the unload: %s", slot, exc)

    async def _restore_kept_slots(self) -> None:
        kept, self._kept_slots = self._kept_slots, []
        for slot in kept:
            try:
                await self.supervisor.command(
                    p.RestoreSlot(slot, KEPT_SLOT_FILE.format(slot=slot)))
            except (EngineCommandError, TimeoutError) as exc:
                log.info("slot %d's kept session was not restored (%s); it starts afresh",
                         slot, exc)

    def _is_shrunk(self) -> bool:
        cache = cache_info(self.engine_info)
        return cache is not None and cache["num_slots"] < cache["max_slots"]

    async def _shrink(self, keep_free_mib: int) -> dict[str, Any]:
        """shrink_experts: fewer expert slots until keep_free_mib MiB are free; serving goes
        on from the partial cache, and a grower task maps slots back as VRAM frees."""
        if not self.is_up():
            return {"changed": False, "reason": "no model is loaded"}
        if self.levels()["weights"] == "sleeping" or self.levels()["experts"] == "released":
            return {"changed": False, "reason": "the expert cache is not resident"}

        async def refresh() -> dict[str, Any]:
            await self._refresh()
            return self.engine_info

        try:
            result = await self.shrinker.shrink(self.supervisor.command, refresh,
                                                keep_free_mib * MIB)
        except EngineCommandError as exc:
            raise lv.service_error("shrink_experts", exc) from None
        await self._refresh()
        self._changed.set()
        if self.shrinker.keep_free_bytes is not None and self._grow_task is None:
            self._grow_task = asyncio.create_task(self._grow(), name="strata-expert-grower")
        return result

    async def _grow(self) -> None:
        """Map expert slots back while a shrink target is set and VRAM allows."""
        try:
            while self.shrinker.keep_free_bytes is not None:
                await asyncio.sleep(GROW_INTERVAL_S)
                if self.gate.is_in_use or self.transition or not self.is_up():
                    continue
                async with self.gate.exclusive():
                    if await self.shrinker.grow_step(self.supervisor.command, self.engine_info):
                        self.shrinker.clear()
                    await self._refresh()
                self._changed.set()
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
        if keep_sessions:
            await self._keep_sessions()
        restart = self._restart_task
        if restart is not None and restart is not asyncio.current_task():
            restart.cancel()  # unloaded on purpose: no restart after an earlier crash
        await supervisor.stop()
        self.engine_info, self.engine_state, self._engine_pid = {}, None, None
        self._is_sleeping = self._experts_released = self._session_offloaded = False
        standby_pid = await supervisor.start_standby() if self.keep_standby else None
        self._changed.set()
        return {"changed": was_running, "standby_pid": standby_pid}

    # ---- restarts after a crash ------------------------------------------------------------

    def _on_supervisor_state(self, state: str) -> None:
        """A loaded engine that fails (crash, OOM kill, killed for a timeout) is restarted
        now, with the supervisor's backoff, so /health recovers without waiting for a client."""
        was_loaded, self._supervisor_state = self._supervisor_state == "loaded", state
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

    # ---- engine ----------------------------------------------------------------------------

    async def _engine_level(self, action: str) -> dict[str, Any]:
        try:
            reply = await self.supervisor.command(_COMMANDS[action]())
        except EngineCommandError as exc:
            raise lv.service_error(action, exc) from None
        except TimeoutError:
            raise ServiceError(
                503, "engine_timeout", f"the engine did not answer {action.replace('_', ' ')} "
                f"within {self.supervisor.command_timeout_s:.0f} s; see the log and retry"
            ) from None
        return dict(reply.result)

    async def _refresh(self) -> None:
        """Cache the engine's status: the only place engine_info is written."""
        if self.supervisor.pid is None:
            self.engine_info, self.engine_state = {}, None
            return
        try:
            status = await self.supervisor.command(p.GetStatus(), STATUS_TIMEOUT_S)
        except (EngineCommandError, TimeoutError) as exc:
            log.debug("engine status not refreshed: %s", exc)
            return
        self.engine_state, self.engine_info = status.state, dict(status.info)

    # ---- idle timers -----------------------------------------------------------------------

    def _mark_activity(self) -> None:
        """A request ended or the model came back: every idle clock starts again."""
        self.idle_since_s = time.monotonic()
        self._idle_epoch += 1
        self._fired_s.clear()
        self._changed.set()

    def _next_due(self) -> tuple[str, str, float] | None:
        """(key, action, seconds until due) of the next timer; the deepest wins a tie."""
        if self.is_busy or self.transition:
            return None
        candidates = [
            (left_s, -i, key, action)
            for i, (key, _, action) in enumerate(IDLE_TIMERS)
            if (left_s := self._countdowns_s()[key]) is not None
        ]
        if not candidates:
            return None
        left_s, _, key, action = min(candidates)
        return key, action, left_s

    async def _run_timers(self) -> None:
        while not self._is_stopping:
            self._changed.clear()
            due = self._next_due()
            if due is None:
                await self._changed.wait()
                continue
            key, action, left_s = due
            if left_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left_s)
                continue
            try:
                await self._fire(key, action)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one firing must not end the timers
                log.exception("idle timer %s failed", key)

    async def _fire(self, key: str, action: str) -> None:
        epoch = self._idle_epoch
        self._fired_s[key] = time.monotonic()  # once per idle period, whatever the outcome
        async with self.gate.exclusive():
            if self.is_busy or epoch != self._idle_epoch:
                return  # a request came while we waited: its end restarted the clock
            cause = f"idle for {self.idle_timeouts_s[key]:g} s"
            log.info("%s: %s", cause, action.replace("_", " "))
            try:
                await self._go_down(action)
                self._on_change(action, True, cause)
            except ServiceError as exc:
                if exc.code == "not_applicable":
                    self._inapplicable.add(key)
                    del self._fired_s[key]  # it never ran: do not report it as fired
                    log.info("idle %s does not apply: %s", action, exc.message)
                else:
                    self.last_error = exc.message
                    self._on_change(action, False, cause)
                    log.warning("idle %s failed: %s", action, exc.message)
