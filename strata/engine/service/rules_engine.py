"""Runs the rules: watchers push process events, one driver task per rule acts at once.

Process triggers react to the process watcher (process_watch.py, a tick every 100 ms) and the
GPU watcher (the NVML process list, same tick), not to a slow poll, so the action starts within
a tick of the process's start. An episode is per process: each new matching process fires the
rule again, even while an earlier one runs (the action is a no-op when the level is already
reached); the trigger ends when the last matching process exits. The VRAM triggers
(process_vram, free_vram) are read every `interval_s`.

When a trigger ends, the restore retries with backoff until it succeeds or a new trigger
begins; each attempt is refused at once by the VRAM guard if the model does not fit yet
(vram_wait_s=0), so the lane is never held while another program still lets go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from strata.engine.core.memory.vram import gpu_pids
from strata.engine.service.process_watch import (
    ProcessEvent,
    ProcessInfo,
    ProcessWatcher,
    read_process,
)
from strata.engine.service.rules import (
    ACTION_VERB,
    PROCESS_TRIGGERS,
    RESTORE_ACTION,
    Rule,
    RuleEvent,
    gib,
    rule_hits,
    rules_from_config,
)
from strata.engine.service.telemetry import GpuSnapshot

log = logging.getLogger(__name__)

BUSY_RETRY_S = 0.1  # a request runs: the down action is tried again this soon
RESTORE_BACKOFF_S = (0.25, 0.5, 1.0, 2.0, 4.0, 5.0)  # then 5 s until it succeeds
VRAM_INTERVAL_S = 0.5


@dataclass
class _RuleState:
    """One rule's trigger and what its driver has done about it."""

    rule: Rule
    keys: set = field(default_factory=set)  # matching pids, or {"vram"}: non-empty = on
    cause: str = ""
    num_new: int = 0  # matches not acted on yet
    is_applied: bool = False  # an action of this episode changed a level: the end undoes it
    has_reported_failure: bool = False
    freed_bytes: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


def _lister_watcher(lister: Callable[[], Iterable[ProcessInfo]]) -> ProcessWatcher:
    """A watcher over a function that lists whole ProcessInfos (tests, other platforms)."""
    listing: dict[int, ProcessInfo] = {}

    def list_pids() -> list[int]:
        found = {p.pid: p for p in lister()}
        listing.clear()
        listing.update(found)
        return list(found)

    return ProcessWatcher(list_pids=list_pids, reader=listing.get, young_s=0)


class RulesEngine:
    """Evaluates rules on watcher events and VRAM readings; acts through service.control."""

    def __init__(
        self,
        service: Any,  # a ServiceFacade: control() and status()
        rules: list[Rule],
        on_event: Callable[[RuleEvent], None] = lambda event: None,
        process_lister: Callable[[], Iterable[ProcessInfo]] | None = None,
        vram_reader: Callable[[], GpuSnapshot | None] = lambda: None,
        own_pids: Callable[[], set[int]] = lambda: {os.getpid()},
        is_enabled: bool = True,
        *,
        watcher: ProcessWatcher | None = None,
        gpu_pid_lister: Callable[[], Iterable[int]] = gpu_pids,
        restore_backoff_s: tuple[float, ...] = RESTORE_BACKOFF_S,
    ):
        self.service = service
        self.on_event = on_event
        self.vram_reader = vram_reader
        self.own_pids = own_pids
        self.is_enabled = is_enabled
        self.restore_backoff_s = restore_backoff_s
        self.watcher = watcher or (
            _lister_watcher(process_lister) if process_lister else ProcessWatcher())
        self.gpu_watcher = ProcessWatcher(list_pids=gpu_pid_lister, reader=self._gpu_process,
                                          young_s=0, is_first_reported=False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._states: dict[str, _RuleState] = {}
        self._restore_epoch = 0  # bumped by every fire: a restore in backoff gives up
        self._has_warned_blind = False
        self.rules: list[Rule] = []
        self.watcher.add_listener(lambda events: self._post("process", events))
        self.gpu_watcher.add_listener(lambda events: self._post("gpu_process", events))
        self.set_rules(rules)

    def _gpu_process(self, pid: int) -> ProcessInfo:
        """A GPU user's details: as the process watcher read them, else read now; a process
        of another PID namespace (a container) cannot be read and still counts."""
        return self.watcher.known.get(pid) or read_process(pid) or ProcessInfo(pid, f"pid {pid}")

    # ---- configuration -----------------------------------------------------------------

    def set_rules(self, rules: list[Rule]) -> None:
        """Replace the rules; episodes of rules that are gone are dropped without restoring."""
        self.rules = list(rules)
        names = {r.name for r in self.rules}
        for name in list(self._states):
            if name not in names:
                self._drop(name)
        for rule in self.rules:
            state = self._states.get(rule.name)
            if state is not None and state.rule != rule:
                self._drop(rule.name)  # changed: start its episode afresh
        self._resync()

    def set_enabled(self, is_enabled: bool) -> None:
        """Rules off forgets running episodes (what they released returns with the next
        request); on again looks at the processes running now."""
        self.is_enabled = is_enabled
        if not is_enabled:
            for name in list(self._states):
                self._drop(name)
        else:
            self._resync()

    def _drop(self, name: str) -> None:
        state = self._states.pop(name, None)
        if state is not None and state.task is not None:
            state.task.cancel()

    def _state(self, rule: Rule) -> _RuleState:
        state = self._states.get(rule.name)
        if state is None:
            state = self._states[rule.name] = _RuleState(rule)
            state.idle.set()
        if state.task is None and self._loop is not None:
            state.task = self._loop.create_task(self._drive(state), name=f"rule-{rule.name}")
        return state

    def _active_rules(self, trigger_kinds: tuple[str, ...]) -> list[Rule]:
        if not self.is_enabled:
            return []
        return [r for r in self.rules if r.is_enabled and r.trigger in trigger_kinds]

    def _resync(self) -> None:
        """Look at the processes running now (after set_rules or set_enabled); the GPU's
        users of the moment are a baseline, not programs starting."""
        if self._loop is None:
            return
        events = [ProcessEvent("seen", p.pid, p) for p in self.watcher.running()]
        self._on_events("process", events)

    # ---- process events (on the loop) ---------------------------------------------------

    def _post(self, kind: str, events: list[ProcessEvent]) -> None:
        """Watcher thread -> loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop is shutting down
                loop.call_soon_threadsafe(self._on_events, kind, events)

    def _on_events(self, kind: str, events: list[ProcessEvent]) -> None:
        rules = self._active_rules((kind,))
        if not rules or not events:
            return
        own: set[int] | None = None
        for rule in rules:
            state = self._state(rule)
            is_changed = False
            for event in events:
                if event.kind == "gone" or event.info is None:
                    if event.pid in state.keys:
                        state.keys.discard(event.pid)
                        is_changed = True
                    continue
                is_hit = rule_hits(rule, event.info)
                if is_hit:
                    if own is None:  # psutil walks our children: only when something matches
                        own = self.own_pids()
                    is_hit = event.pid not in own
                if is_hit and event.pid not in state.keys:
                    state.keys.add(event.pid)
                    state.num_new += 1
                    state.cause = f"{event.info.name or 'process'} pid {event.pid}"
                    is_changed = True
                    log.info("rule %s: %s (pid %d) started", rule.name, state.cause, event.pid)
                elif not is_hit and event.pid in state.keys:  # exec'd into something else
                    state.keys.discard(event.pid)
                    is_changed = True
            if is_changed:
                state.changed.set()

    # ---- VRAM triggers ------------------------------------------------------------------

    def _vram_causes(self, rules: list[Rule]) -> dict[str, str | None]:
        """For each VRAM rule, why it triggers now (a short phrase) or None (in a thread)."""
        gpu = self.vram_reader() if rules else None
        own = self.own_pids() if rules else set()
        causes: dict[str, str | None] = {}
        for rule in rules:
            state = self._states.get(rule.name)
            if gpu is None:
                causes[rule.name] = state.cause if state and state.keys else None
            elif rule.trigger == "process_vram":
                hog = next((p for p in gpu.processes if p.pid not in own
                            and (p.used_bytes or 0) > rule.threshold_gib * 1024**3), None)
                causes[rule.name] = f"{hog.name} uses {gib(hog.used_bytes)}" if hog else None
                self._warn_if_blind(gpu.processes, own)
            else:
                # Hysteresis: the episode ends only when taking our bytes back still leaves the
                # threshold free; otherwise release -> free rises -> restore -> free falls loops.
                reserve = state.freed_bytes if state and state.keys else 0
                is_low = gpu.free_bytes - reserve < rule.threshold_gib * 1024**3
                causes[rule.name] = f"free VRAM below {rule.threshold_gib:g} GiB" if is_low \
                    else None
        return causes

    def _warn_if_blind(self, processes: Iterable[Any], own: set[int]) -> None:
        # Under Windows' WDDM, NVML lists GPU processes without their VRAM: such a rule can
        # never fire, which a user should hear once rather than wait for.
        others = [p for p in processes if p.pid not in own]
        if others and all(p.used_bytes is None for p in others) and not self._has_warned_blind:
            self._has_warned_blind = True
            log.warning("the driver reports no per-process VRAM here (Windows WDDM): "
                        "process_vram rules cannot fire; use a free_vram or process rule")

    def _apply_vram_causes(self, causes: Mapping[str, str | None]) -> None:
        for rule in self._active_rules(("process_vram", "free_vram")):
            if rule.name not in causes:
                continue
            state, cause = self._state(rule), causes[rule.name]
            if cause and not state.keys:
                state.keys, state.cause, state.num_new = {"vram"}, cause, 1
                state.changed.set()
            elif not cause and state.keys:
                state.keys = set()
                state.changed.set()

    # ---- running ------------------------------------------------------------------------

    def _bind(self) -> None:
        self._loop = asyncio.get_running_loop()
        for rule in self.rules:
            if rule.is_enabled:
                self._state(rule)

    def _scan_all(self, vram_rules: list[Rule]) -> dict[str, str | None]:
        self.watcher.scan()
        if self._active_rules(("gpu_process",)):
            self.gpu_watcher.scan()
        return self._vram_causes(vram_rules)

    async def poll_once(self) -> list[RuleEvent]:
        """One synchronous round (tests): scan, act, and wait until every driver has settled
        (done, or waiting in a backoff); returns the events of this round."""
        if not self.is_enabled:
            return []
        self._bind()
        events: list[RuleEvent] = []
        on_event, self.on_event = self.on_event, lambda e: (events.append(e), on_event(e))
        try:
            vram_rules = self._active_rules(("process_vram", "free_vram"))
            try:
                causes = await asyncio.to_thread(self._scan_all, vram_rules)
            except Exception:  # a broken lister/reader must not stop the server
                log.exception("rules: reading processes or VRAM failed; will retry")
                return []
            await asyncio.sleep(0)  # the watchers' posted events run first
            self._apply_vram_causes(causes)
            await self.settle()
        finally:
            self.on_event = on_event
        return events

    async def settle(self, timeout_s: float = 30.0) -> None:
        """Wait until every driver waits for a change (or sleeps in a backoff)."""
        async with asyncio.timeout(timeout_s):
            while any(s.changed.is_set() or not s.idle.is_set() for s in self._states.values()):
                await asyncio.sleep(0.005)

    async def run(self, interval_s: float = VRAM_INTERVAL_S) -> None:
        """Watch processes (own threads) and read VRAM every interval_s, until cancelled."""
        self._bind()
        self.watcher.start()
        try:
            while True:
                try:
                    if self._active_rules(("gpu_process",)):
                        self.gpu_watcher.start()
                    else:
                        self.gpu_watcher.stop()
                    vram_rules = self._active_rules(("process_vram", "free_vram"))
                    if vram_rules:
                        causes = await asyncio.to_thread(self._vram_causes, vram_rules)
                        self._apply_vram_causes(causes)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("rules: reading VRAM failed; will retry")
                await asyncio.sleep(interval_s)
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop the watchers and the rule drivers (run() does this when cancelled)."""
        self._loop = None  # a watcher event still on its way starts nothing now
        self.watcher.stop()
        self.gpu_watcher.stop()
        for state in self._states.values():
            if state.task is not None:
                state.task.cancel()
                state.task = None

    # ---- the driver: one task per rule --------------------------------------------------

    async def _drive(self, state: _RuleState) -> None:
        while True:
            state.idle.set()
            await state.changed.wait()
            state.changed.clear()
            state.idle.clear()
            try:
                if state.num_new and state.keys:
                    await self._fire(state)
                if not state.keys:
                    state.num_new = 0
                    state.has_reported_failure = False
                    if state.is_applied:
                        await self._end(state)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in one rule must not end its driver
                log.exception("rule %s failed", state.rule.name)

    def _emit(self, event: RuleEvent) -> None:
        log.info("rule %s", event.sentence)
        try:
            self.on_event(event)
        except Exception:
            log.exception("a rule-event listener failed")

    async def _control(self, action: str, **options: Any) -> dict[str, Any]:
        return dict(await self.service.control(action, **options))

    async def _fire(self, state: _RuleState) -> None:
        rule = state.rule
        while state.num_new and state.keys:
            state.num_new = 0
            self._restore_epoch += 1  # a restore waiting in its backoff gives up
            options: dict[str, Any] = {}
            if rule.action == "unload":
                options["keep_sessions"] = True  # the conversation survives the unload
            elif rule.action == "shrink_experts":
                options["keep_free_mib"] = rule.keep_free_mib
            try:
                result = await self._control(rule.action, **options)
            except Exception as exc:  # noqa: BLE001 - any refusal is reported, never raised
                if getattr(exc, "status", None) == 409:  # a request runs: try again shortly
                    state.num_new = max(state.num_new, 1)
                    state.idle.set()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(state.changed.wait(), BUSY_RETRY_S)
                    state.changed.clear()
                    state.idle.clear()
                    continue
                if not state.has_reported_failure:  # not applicable or failed: say so once
                    state.has_reported_failure = True
                    self._emit(RuleEvent(
                        rule.name, rule.action,
                        f"{rule.name}: could not {rule.action.replace('_', ' ')} "
                        f"({getattr(exc, 'message', exc)})", is_ok=False))
                return
            if not result["changed"]:
                log.debug("rule %s: %s changed nothing (%s)", rule.name, rule.action,
                          result.get("reason"))
                continue
            state.is_applied = True
            freed = int(result["freed_bytes"])  # the lifecycle computed it, once
            state.freed_bytes += freed
            reason = f"for {state.cause}" if rule.trigger in PROCESS_TRIGGERS \
                else f"because {state.cause}"
            if rule.trigger == "process" and state.cause != rule.name:
                reason = f"for {rule.name} ({state.cause})"
            sentence = (f"Released {gib(freed)} {reason} ({rule.action.replace('_', ' ')})"
                        if freed else f"{ACTION_VERB[rule.action]} {reason}")
            self._emit(RuleEvent(rule.name, rule.action, sentence))

    def _others_hold(self, state: _RuleState) -> _RuleState | None:
        return next((o for o in self._states.values()
                     if o is not state and o.keys and o.rule.is_enabled), None)

    async def _end(self, state: _RuleState) -> None:
        rule = state.rule
        ended = (f"{rule.name} ended" if rule.trigger in PROCESS_TRIGGERS
                 else f"{rule.name}: {state.cause} no more")
        freed, state.freed_bytes = state.freed_bytes, 0
        holder = self._others_hold(state)
        if holder is not None:  # another trigger still holds the GPU: its end restores
            holder.is_applied = True
            holder.freed_bytes += freed
            state.is_applied = False
            log.info("rule %s: %s ended; %s still holds, so it restores later", rule.name,
                     state.cause, holder.rule.name)
            return
        restore = RESTORE_ACTION[rule.action]
        if rule.on_end == "wait" or restore is None:
            state.is_applied = False
            self._emit(RuleEvent(rule.name, "wait",
                                 f"{ended}; the model comes back with the next request"))
            return
        epoch, attempt = self._restore_epoch, 0
        while True:
            try:
                # load brings back whatever is down (load, wake, refill): a deeper level that
                # another rule reached meanwhile comes back too.
                await self._control("refill_experts" if rule.action == "shrink_experts"
                                    else "load", vram_wait_s=0)
            except Exception as exc:  # noqa: BLE001 - every refusal is retried or reported
                message = getattr(exc, "message", exc)
                if getattr(exc, "status", None) == 400:  # nothing a retry changes
                    state.is_applied = False
                    self._emit(RuleEvent(rule.name, restore, f"{ended}; could not "
                                         f"{restore.replace('_', ' ')} ({message})", is_ok=False))
                    return
                delay_s = self.restore_backoff_s[min(attempt, len(self.restore_backoff_s) - 1)]
                if attempt == 0:
                    self._emit(RuleEvent(rule.name, restore, f"{ended}; could not "
                                         f"{restore.replace('_', ' ')} yet ({message}); "
                                         "retrying", is_ok=False))
                log.info("rule %s: restore attempt %d refused (%s); next in %.2f s",
                         rule.name, attempt + 1, message, delay_s)
                attempt += 1
                state.idle.set()  # settled: waiting in the backoff
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(state.changed.wait(), delay_s)
                state.idle.clear()
                if state.changed.is_set() or epoch != self._restore_epoch:
                    log.info("rule %s: a new trigger began; the restore stops", rule.name)
                    if epoch != self._restore_epoch and not state.keys:
                        self._hand_over(state)
                    return  # the driver sees the change (a new process: fire again)
                continue
            state.is_applied = False
            self._emit(RuleEvent(
                rule.name, restore,
                f"{ended}; took {gib(freed)} back ({restore})" if freed
                else f"{ended}; ran {restore}"))
            return

    def _hand_over(self, state: _RuleState) -> None:
        """Another rule fired while this one's restore waited: that rule's end restores."""
        holder = self._others_hold(state)
        if holder is not None:
            holder.is_applied = True
            state.is_applied = False


def rules_engine_from_config(service: Any, config: Mapping[str, Any], **kwargs: Any) -> RulesEngine:
    """A RulesEngine for a parsed config file: its [[rules]] tables and [tray] rules_enabled.

    The headless server and the tray both call this; start it with
    `asyncio.create_task(engine.run(interval_s))`.
    """
    is_enabled = bool((config.get("tray") or {}).get("rules_enabled", True))
    return RulesEngine(
        service, rules_from_config(config.get("rules", [])), is_enabled=is_enabled, **kwargs
    )
