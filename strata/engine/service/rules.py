"""Rules: give VRAM back when something else needs the GPU, take it back when it is done.

A rule is trigger -> action -> what to do when the trigger ends. Triggers: a process whose
executable (or, for Python, script) matches a pattern starts (command line only with
match = "cmdline"; rule_match.py); another process starts using the GPU (NVML, minus an
ignore list); another process holds more than N GiB of VRAM; free VRAM is below N GiB.
This module is the rules' configuration (Qt-free: the tray and `strata serve` both read the
config file's `[[rules]]` tables); rules_engine.py runs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from strata.engine.service.process_watch import ProcessInfo
from strata.engine.service.rule_match import MATCH_MODES, matches
from strata.errors import StrataError
from strata.units import GIB

__all__ = [
    "ACTIONS",
    "GIB",
    "MATCH_MODES",
    "ON_END",
    "PRESETS",
    "TRIGGERS",
    "ProcessInfo",
    "Rule",
    "RuleConfigError",
    "RuleEvent",
    "matches",
    "rule_from_table",
    "rule_to_table",
    "rules_from_config",
]

TRIGGERS = ("process", "gpu_process", "process_vram", "free_vram")
PROCESS_TRIGGERS = ("process", "gpu_process")  # fired per process, by the watchers
ACTIONS = ("shrink_experts", "release_experts", "offload_session", "sleep", "unload")
ON_END = ("restore", "wait")
# The control action that undoes each level; an offloaded session comes back with the next
# request (the control vocabulary has no separate restore), so "restore" has nothing to do.
RESTORE_ACTION = {
    "shrink_experts": "refill_experts",  # it also grows back by itself as VRAM frees
    "release_experts": "refill_experts",
    "offload_session": None,
    "sleep": "wake",
    "unload": "load",
}
ACTION_VERB = {
    "shrink_experts": "Shrank the expert cache",
    "release_experts": "Released experts",
    "offload_session": "Offloaded the session",
    "sleep": "Put the model to sleep",
    "unload": "Unloaded the model",
}


class RuleConfigError(StrataError):
    """A [[rules]] table that cannot be used; the message names the rule and the fix."""


@dataclass(frozen=True)
class Rule:
    """One rule. patterns: globs on what a process runs (rule_match.py); match: "exe" (the
    executable, argv[0], a Python script) or "cmdline" (the whole command line as well);
    ignore: processes a gpu_process trigger leaves alone (same globs)."""

    name: str
    trigger: str
    action: str = "sleep"
    on_end: str = "restore"
    patterns: tuple[str, ...] = ()
    threshold_gib: float = 0.0
    is_enabled: bool = True
    match: str = "exe"
    ignore: tuple[str, ...] = ()
    keep_free_mib: int = 0  # shrink_experts: VRAM to leave free for the other program

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
        if self.action == "shrink_experts" and not self.keep_free_mib > 0:
            raise RuleConfigError(
                f"{where}: shrink_experts needs keep_free_mib > 0, the MiB the other program "
                "needs, e.g. keep_free_mib = 8192")
        if self.keep_free_mib and self.action != "shrink_experts":
            raise RuleConfigError(f"{where}: keep_free_mib applies to shrink_experts only, not "
                                  f"{self.action}; remove it or use action = \"shrink_experts\"")
        if self.match not in MATCH_MODES:
            raise RuleConfigError(f"{where}: unknown match {self.match!r}; use exe or cmdline")
        if self.trigger in ("process_vram", "free_vram") and not self.threshold_gib > 0:
            raise RuleConfigError(
                f"{where}: {self.trigger} needs threshold_gib > 0, e.g. threshold_gib = 4"
            )


# What the programs really run (tests/service/test_rule_match.py holds real command lines).
PRESETS: dict[str, Rule] = {
    "comfyui": Rule(
        "ComfyUI", "process", "sleep", "restore",
        # main.py under a ComfyUI folder (git clone, portable, desktop's resources/ComfyUI),
        # and the desktop app itself.
        ("*/comfyui/main.py", "*/comfyui-*/main.py", "comfyui", "comfyui.exe"),
    ),
    "steam": Rule("Steam game", "process", "unload", "restore", ("*/steamapps/common/*",)),
    "blender": Rule("Blender", "process", "sleep", "restore", ("blender", "blender.exe")),
    "sd-webui": Rule(
        "Stable Diffusion web UI", "process", "sleep", "restore",
        # A1111 and Forge: launch.py / webui.py under their clone or one-click package.
        ("*/stable-diffusion-webui*/launch.py", "*/stable-diffusion-webui*/webui.py",
         "*/webui_forge*/webui/launch.py", "*/sd-webui*/launch.py", "*/sd-webui*/webui.py"),
    ),
    "fooocus": Rule(
        "Fooocus", "process", "sleep", "restore",
        ("*/fooocus/entry_with_update.py", "*/fooocus/launch.py", "*/fooocus/webui.py"),
    ),
    "invokeai": Rule(
        "InvokeAI", "process", "sleep", "restore",
        ("invokeai-web", "invokeai-web.exe", "invokeai.app.run_app"),
    ),
    # Desktop programs that use the GPU all the time are not "another program starting".
    "any-gpu-app": Rule(
        "Another GPU app", "gpu_process", "sleep", "restore",
        ignore=("xorg", "xwayland", "gnome-shell", "kwin_wayland", "kwin_x11", "plasmashell",
                "mutter", "sway", "hyprland", "dwm.exe", "explorer.exe", "steamwebhelper*",
                "firefox*", "chrome*", "msedge*", "discord*", "code", "code.exe")),
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
            "match": preset.match,
            "ignore": preset.ignore,
        }
    if "pattern" in data:
        data["patterns"] = [data.pop("pattern")]
    if "enabled" in data:
        data["is_enabled"] = data.pop("enabled")
    known = {"name", "trigger", "action", "on_end", "patterns", "threshold_gib", "is_enabled",
             "match", "ignore", "keep_free_mib"}
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
    ignore = merged.get("ignore", ())
    merged["ignore"] = (ignore,) if isinstance(ignore, str) else tuple(str(p) for p in ignore)
    merged["match"] = str(merged.get("match", "exe"))
    try:
        merged["keep_free_mib"] = int(merged.get("keep_free_mib", 0))
    except (TypeError, ValueError):
        raise RuleConfigError(f"rule {index + 1}: keep_free_mib must be a whole number of "
                              "MiB") from None
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
    if rule.match != "exe":
        table["match"] = rule.match
    if rule.ignore:
        table["ignore"] = list(rule.ignore)
    if rule.keep_free_mib:
        table["keep_free_mib"] = rule.keep_free_mib
    return table


@dataclass(frozen=True)
class RuleEvent:
    """What a rule did, for the log and the tray's notification."""

    rule: str
    action: str
    sentence: str
    is_ok: bool = True


def gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def rule_hits(rule: Rule, proc: ProcessInfo) -> bool:
    """True when proc starts rule's trigger (a process or gpu_process rule)."""
    if rule.trigger == "process":
        return matches(rule.patterns, proc, rule.match)
    return not matches(rule.ignore, proc, rule.match)  # gpu_process: any GPU user not ignored

