"""Rules: give VRAM back when something else needs the GPU, take it back when it is done.

A rule is trigger -> action -> what to do when the trigger ends. Triggers: a process whose name,
path or command line matches a pattern is running (psutil); another process holds more than N
GiB of VRAM; free VRAM is below N GiB. Qt-free: the tray and `strata serve` both run it from
the config file's `[[rules]]` tables. Each trigger episode fires its rule at most once.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil

from strata.engine.service.telemetry import GpuSnapshot
from strata.errors import StrataError
from strata.units import GIB

log = logging.getLogger(__name__)

TRIGGERS = ("process", "process_vram", "free_vram")
ACTIONS = ("release_experts", "offload_session", "sleep", "unload")
ON_END = ("restore", "wait")
# The control action that undoes each level; an offloaded session comes back with the next
# request (the control vocabulary has no separate restore), so "restore" has nothing to do.
RESTORE_ACTION = {
    "release_experts": "refill_experts",
    "offload_session": None,
    "sleep": "wake",
    "unload": "load",
}
_ACTION_VERB = {
    "release_experts": "Released experts",
    "offload_session": "Offloaded the session",
    "sleep": "Put the model to sleep",
    "unload": "Unloaded the model",
}


class RuleConfigError(StrataError):
    """A [[rules]] table that cannot be used; the message names the rule and the fix."""


@dataclass(frozen=True)
class Rule:
    """One rule. patterns match a process name, executable path or command line (glob, any case)."""

    name: str
    trigger: str
    action: str = "sleep"
    on_end: str = "restore"
    patterns: tuple[str, ...] = ()
    threshold_gib: float = 0.0
    is_enabled: bool = True

    def __post_init__(self) -> None:
        where = f"rule {self.name!r}"
        if self.trigger not in TRIGGERS:
            raise RuleConfigError(
                f"{where}: unknown trigger {self.trigger!r}; use one of {', '.join(TRIGGERS)}"
            )
        if self.action not in ACTIONS:
            raise RuleConfigError(
                f"{where}: unknown action {self.action!r}; use one of {', '.join(ACTIONS)}"
            )
        if self.on_end not in ON_END:
            raise RuleConfigError(f"{where}: unknown on_end {self.on_end!r}; use restore or wait")
        if self.trigger == "process" and not any(p.strip() for p in self.patterns):
            raise RuleConfigError(
                f'{where}: a process trigger needs a pattern, e.g. pattern = "*ComfyUI*"'
            )
        if self.trigger != "process" and not self.threshold_gib > 0:
            raise RuleConfigError(
                f"{where}: {self.trigger} needs threshold_gib > 0, e.g. threshold_gib = 4"
            )


PRESETS: dict[str, Rule] = {
    "comfyui": Rule("ComfyUI", "process", "sleep", "restore", ("*comfyui*",)),
    "steam": Rule("Steam game", "process", "unload", "restore", ("*steamapps/common/*",)),
    "blender": Rule("Blender", "process", "sleep", "restore", ("blender", "blender.exe")),
    "sd-webui": Rule(
        "Stable Diffusion web UI",
        "process",
        "sleep",
        "restore",
        ("*stable-diffusion-webui*", "*sd-webui-forge*", "*webui-forge*"),
    ),
}


def rule_from_table(table: Mapping[str, Any], index: int = 0) -> Rule:
    """A Rule from one [[rules]] table; `preset = "comfyui"` starts from a preset."""
    data = dict(table)
    base: dict[str, Any] = {}
    if "preset" in data:
        key = str(data.pop("preset"))
        if key not in PRESETS:
            raise RuleConfigError(
                f"rule {index + 1}: unknown preset {key!r}; use one of {', '.join(PRESETS)}"
            )
        preset = PRESETS[key]
        base = {
            "name": preset.name,
            "trigger": preset.trigger,
            "action": preset.action,
            "on_end": preset.on_end,
            "patterns": preset.patterns,
        }
    if "pattern" in data:
        data["patterns"] = [data.pop("pattern")]
    if "enabled" in data:
        data["is_enabled"] = data.pop("enabled")
    known = {"name", "trigger", "action", "on_end", "patterns", "threshold_gib", "is_enabled"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise RuleConfigError(
            f"rule {index + 1}: unknown key(s) {', '.join(unknown)}; allowed: "
            f"preset, pattern, {', '.join(sorted(known - {'is_enabled'}))}, enabled"
        )
    merged = {**base, **data}
    merged.setdefault("name", f"rule {index + 1}")
    if "trigger" not in merged:
        raise RuleConfigError(
            f'rule {index + 1}: no trigger; set trigger = "process" (or a preset)'
        )
    patterns = merged.get("patterns", ())
    merged["patterns"] = (
        (patterns,) if isinstance(patterns, str) else tuple(str(p) for p in patterns)
    )
    try:
        merged["threshold_gib"] = float(merged.get("threshold_gib", 0.0))
    except (TypeError, ValueError):
        raise RuleConfigError(f"rule {index + 1}: threshold_gib must be a number of GiB") from None
    return Rule(**merged)


def rules_from_config(tables: Iterable[Mapping[str, Any]]) -> list[Rule]:
    """Every rule of the config file's [[rules]] list, validated."""
    return [rule_from_table(table, i) for i, table in enumerate(tables)]


def rule_to_table(rule: Rule) -> dict[str, Any]:
    """The [[rules]] table for a rule (the inverse of rule_from_table)."""
    table: dict[str, Any] = {
        "name": rule.name,
        "trigger": rule.trigger,
        "action": rule.action,
        "on_end": rule.on_end,
        "enabled": rule.is_enabled,
    }
    if rule.patterns:
        table["patterns"] = list(rule.patterns)
    if rule.threshold_gib:
        table["threshold_gib"] = rule.threshold_gib
    return table


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    name: str
    exe: str = ""
    cmdline: str = ""


def list_processes() -> list[ProcessInfo]:
    """Running processes (psutil), with the fields a pattern may match."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "exe", "cmdline"]):
        info = proc.info
        found.append(
            ProcessInfo(
                info["pid"],
                info.get("name") or "",
                info.get("exe") or "",
                " ".join(info.get("cmdline") or ()),
            )
        )
    return found


def matches(patterns: Iterable[str], proc: ProcessInfo) -> bool:
    """True when a glob pattern (any case; \\ read as /) fits proc's name, path or command line."""
    fields = [
        proc.name.lower(),
        proc.exe.lower().replace("\\", "/"),
        proc.cmdline.lower().replace("\\", "/"),
    ]
    for pattern in patterns:
        pat = pattern.strip().lower().replace("\\", "/")
        if pat and any(fnmatch.fnmatchcase(text, pat) for text in fields if text):
            return True
    return False


@dataclass(frozen=True)
class RuleEvent:
    """What a rule did, for the log and the tray's notification."""

    rule: str
    action: str
    sentence: str
    is_ok: bool = True


@dataclass
class _Episode:
    cause: str
    has_fired: bool = False
    is_applied: bool = False  # the action succeeded, so the end of the episode may undo it
    freed_bytes: int = 0


def held_vram_bytes(status: Mapping[str, Any]) -> int:
    """Bytes Strata holds on the GPU now, summed over the arenas of a status() dict."""
    arenas = status.get("vram") or {}
    return sum(int((a or {}).get("resident_bytes") or 0) for a in arenas.values())


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


@dataclass
class RulesEngine:
    """Evaluates rules against injected process and VRAM readers; acts through service.control."""

    service: Any  # a ServiceFacade: control() and status()
    rules: list[Rule]
    on_event: Callable[[RuleEvent], None] = lambda event: None
    process_lister: Callable[[], Iterable[ProcessInfo]] = list_processes
    vram_reader: Callable[[], GpuSnapshot | None] = lambda: None
    own_pids: Callable[[], set[int]] = lambda: {os.getpid()}
    is_enabled: bool = True
    _episodes: dict[str, _Episode] = field(default_factory=dict)
    _has_warned_blind: bool = False

    def _warn_if_blind(self, processes: list[Any], own: set[int]) -> None:
        # Under Windows' WDDM, NVML lists GPU processes without their VRAM: such a rule can
        # never fire, which a user should hear once rather than wait for.
        others = [p for p in processes if p.pid not in own]
        if others and all(p.used_bytes is None for p in others) and not self._has_warned_blind:
            self._has_warned_blind = True
            log.warning("the driver reports no per-process VRAM here (Windows WDDM): "
                        "process_vram rules cannot fire; use a free_vram or process rule")

    def set_rules(self, rules: list[Rule]) -> None:
        """Replace the rules; episodes of rules that are gone are dropped without restoring."""
        self.rules = list(rules)
        names = {r.name for r in rules}
        self._episodes = {k: v for k, v in self._episodes.items() if k in names}

    def set_enabled(self, is_enabled: bool) -> None:
        """Rules off forgets running episodes; what they released returns with the next request."""
        self.is_enabled = is_enabled
        if not is_enabled:
            self._episodes.clear()

    def _causes(self, rules: list[Rule]) -> dict[str, str | None]:
        """For each rule, why it triggers now (a short phrase) or None."""
        needs_procs = any(r.trigger == "process" for r in rules)
        needs_gpu = any(r.trigger != "process" for r in rules)
        procs = list(self.process_lister()) if needs_procs else []
        gpu = self.vram_reader() if needs_gpu else None
        own = self.own_pids()
        causes: dict[str, str | None] = {}
        for rule in rules:
            cause = None
            if rule.trigger == "process":
                hit = next(
                    (p for p in procs if p.pid not in own and matches(rule.patterns, p)), None
                )
                cause = rule.name if hit else None
            elif gpu is not None and rule.trigger == "process_vram":
                hog = next(
                    (
                        p
                        for p in gpu.processes
                        if p.pid not in own and (p.used_bytes or 0) > rule.threshold_gib * GIB
                    ),
                    None,
                )
                cause = f"{hog.name} uses {gib(hog.used_bytes)}" if hog else None
                self._warn_if_blind(gpu.processes, own)
            elif gpu is not None and rule.trigger == "free_vram":
                episode = self._episodes.get(rule.name)
                # Hysteresis: the episode ends only when taking our bytes back still leaves the
                # threshold free; otherwise release -> free rises -> restore -> free falls loops.
                reserve = episode.freed_bytes if episode else 0
                if gpu.free_bytes - reserve < rule.threshold_gib * GIB:
                    cause = f"free VRAM below {rule.threshold_gib:g} GiB"
            elif gpu is None and rule.name in self._episodes:
                cause = self._episodes[rule.name].cause  # no reading: keep the episode as it is
            causes[rule.name] = cause
        return causes

    async def poll_once(self) -> list[RuleEvent]:
        """One evaluation: fire rules whose trigger began, restore those whose trigger ended."""
        if not self.is_enabled:
            return []
        rules = [r for r in self.rules if r.is_enabled]
        try:
            # psutil's walk over every process takes tens of ms: keep it off the serving loop
            causes = await asyncio.to_thread(self._causes, rules)
        except Exception:  # a broken lister/reader must not stop the server; try next poll
            log.exception("rules: reading processes or VRAM failed; will retry")
            return []
        events = []
        for rule in rules:
            cause, episode = causes.get(rule.name), self._episodes.get(rule.name)
            if cause and (episode is None or not episode.has_fired):
                event = await self._fire(rule, episode or _Episode(cause))
            elif not cause and episode is not None:
                event = await self._end(rule, self._episodes.pop(rule.name))
            else:
                event = None
            if event is not None:
                events.append(event)
                self.on_event(event)
        return events

    async def _fire(self, rule: Rule, episode: _Episode) -> RuleEvent | None:
        self._episodes[rule.name] = episode
        before = held_vram_bytes(self.service.status())
        try:
            result = await self.service.control(rule.action)
        except Exception as exc:
            if getattr(exc, "status", None) == 409:  # a request is running: try again next poll
                del self._episodes[rule.name]
                return None
            episode.has_fired = True  # not applicable or failed: say so once per episode
            return RuleEvent(
                rule.name,
                rule.action,
                f"{rule.name}: could not {rule.action.replace('_', ' ')}"
                f" ({getattr(exc, 'message', exc)})",
                is_ok=False,
            )
        episode.has_fired = episode.is_applied = True
        after = held_vram_bytes(self.service.status())
        episode.freed_bytes = int((result or {}).get("freed_bytes") or max(0, before - after))
        reason = f"for {rule.name}" if rule.trigger == "process" else f"because {episode.cause}"
        if episode.freed_bytes:
            sentence = (
                f"Released {gib(episode.freed_bytes)} {reason} ({rule.action.replace('_', ' ')})"
            )
        else:
            sentence = f"{_ACTION_VERB[rule.action]} {reason}"
        return RuleEvent(rule.name, rule.action, sentence)

    async def _end(self, rule: Rule, episode: _Episode) -> RuleEvent | None:
        if not episode.is_applied:
            return None
        ended = (
            f"{rule.name} ended"
            if rule.trigger == "process"
            else f"{rule.name}: {episode.cause} no more"
        )
        restore = RESTORE_ACTION[rule.action]
        if rule.on_end == "wait" or restore is None:
            return RuleEvent(
                rule.name, "wait", f"{ended}; the model comes back with the next request"
            )
        try:
            await self.service.control(restore)
        except Exception as exc:
            return RuleEvent(
                rule.name,
                restore,
                f"{ended}; could not {restore.replace('_', ' ')} "
                f"({getattr(exc, 'message', exc)}); the next request will retry",
                is_ok=False,
            )
        return RuleEvent(
            rule.name,
            restore,
            f"{ended}; took {gib(episode.freed_bytes)} back ({restore})"
            if episode.freed_bytes
            else f"{ended}; ran {restore}",
        )

    async def run(self, interval_s: float = 2.0) -> None:
        """Poll forever (until cancelled); one failing poll is logged and the loop goes on."""
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("rules: a poll failed; the server keeps running")
            await asyncio.sleep(interval_s)


def rules_engine_from_config(service: Any, config: Mapping[str, Any], **kwargs: Any) -> RulesEngine:
    """A RulesEngine for a parsed config file: its [[rules]] tables and [tray] rules_enabled.

    The headless server and the tray both call this; start it with
    `asyncio.create_task(engine.run(interval_s))`.
    """
    is_enabled = bool((config.get("tray") or {}).get("rules_enabled", True))
    return RulesEngine(
        service, rules_from_config(config.get("rules", [])), is_enabled=is_enabled, **kwargs
    )
