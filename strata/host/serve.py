"""`strata serve`: the Host's parts (host/root.py) until SIGINT/SIGTERM, without a tray.

The config file's [[rules]] run headless here too, through the same RulesEngine as the tray.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from strata.engine.api.listen import ListenError, close_sockets
from strata.engine.service.facade import ServiceError
from strata.engine.service.settings import API_KEY_ENV, ServeSettings, overrides_from_args
from strata.engine.service.telemetry import GpuTelemetry
from strata.errors import StrataError
from strata.host.root import Host
from strata.logs import setup_logging
from strata.units import GIB, MIB

log = logging.getLogger(__name__)
RULES_INTERVAL_S = 0.5  # the VRAM triggers; process triggers react to the watcher at once


class ServeError(StrataError):
    """The server could not start; the message says why and what to do."""


def serve_from_args(args: argparse.Namespace) -> int:
    """Entry of `strata serve`: read the settings, run the server until interrupted."""
    host = Host.from_config(getattr(args, "config", None), overrides_from_args(args))
    setup_logging("serve", "strata: %(message)s")  # a rotating file when run without a console
    if getattr(args, "api_key", None):
        log.warning("--api-key puts the key in the process list, where other users of this "
                    "machine can read it; set %s or api-key in the config file instead",
                    API_KEY_ENV)
        hide_api_key_argument(sys.argv)
    return asyncio.run(serve_host(host))


def hide_api_key_argument(argv: list[str]) -> None:
    """Blank the --api-key value in argv (in place), so no child process is handed it: spawned
    engine processes get a copy of the parent's sys.argv."""
    for i, arg in enumerate(argv):
        if arg == "--api-key" and i + 1 < len(argv):
            argv[i + 1] = "***"
        elif arg.startswith("--api-key="):
            argv[i] = "--api-key=***"


async def serve(
    settings: ServeSettings,
    *,
    service: Any = None,
    stop_event: asyncio.Event | None = None,
    on_listening: Callable[[str], None] | None = None,
    config: Mapping[str, Any] | None = None,
    rules_interval_s: float = RULES_INTERVAL_S,
) -> int:
    """serve_host() for settings and a parsed config file (its [[rules]] and [tray])."""
    return await serve_host(Host(settings, config or {}), service=service,
                            stop_event=stop_event, on_listening=on_listening,
                            rules_interval_s=rules_interval_s)


async def serve_host(
    host: Host,
    *,
    service: Any = None,
    stop_event: asyncio.Event | None = None,
    on_listening: Callable[[str], None] | None = None,
    rules_interval_s: float = RULES_INTERVAL_S,
) -> int:
    """Start the host's service and its API on settings.host:port; stop on SIGINT/SIGTERM or
    stop_event.

    `service` replaces host.build_service() (tests run a fake engine through it);
    on_listening gets the endpoint URL once the port is bound; the config's [[rules]] run
    every rules_interval_s.
    """
    service = service if service is not None else host.build_service()
    stop_event = stop_event or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(signum, stop_event.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / Windows
            pass
    try:
        sockets = host.bind()  # a busy port fails before any load
    except ListenError as exc:
        raise ServeError(str(exc)) from None
    runner = None
    rules_task = None
    try:
        if not await start_interruptibly(service, stop_event):
            log.info("interrupted while loading; stopped")
            return 130
        load_failure = _load_failure(service)
        if load_failure is not None:  # a model that cannot load: say why and exit
            raise ServeError(load_failure)
        listening = await host.listen(service, sockets)
        runner, url = listening.runner, listening.endpoint_url
        status = service.status()
        log.info("serving %s at %s (engine %s)", service.model_id, url, status.get("state"))
        if on_listening is not None:
            on_listening(url)
        rules_task = _start_rules(host, service, rules_interval_s)
        await stop_event.wait()
        log.info("stopping")
    finally:
        if rules_task is not None:
            rules_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await rules_task
        if runner is not None:
            await runner.cleanup()
        close_sockets(sockets)
        await service.stop()
    return 0


async def start_interruptibly(service: Any, stop_event: asyncio.Event) -> bool:
    """service.start(), with "loading MODEL ..." progress; False when stop_event came first.

    A stop (Ctrl-C) during the load cancels it at once; the caller's service.stop() then ends
    the half-started engine process.
    """
    start = asyncio.create_task(service.start(), name="strata-start")
    stopped = asyncio.create_task(stop_event.wait(), name="strata-stop-wait")
    progress = asyncio.create_task(report_load_progress(service), name="strata-load-progress")
    try:
        await asyncio.wait({start, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        progress.cancel()
        stopped.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await progress
    if not start.done():
        start.cancel()
        with contextlib.suppress(asyncio.CancelledError, ServiceError):
            await start
        return False
    try:
        start.result()
    except ServiceError as exc:
        raise ServeError(exc.message) from None
    return True


async def report_load_progress(service: Any, *, poll_s: float = 0.1, tick_s: float = 1.0,
                               stream: Any = None) -> None:
    """Print "loading MODEL (size) ..." once the load begins, then the seconds it has taken
    every tick_s while it goes on (a quick load prints the first line only)."""
    stream = stream or sys.stderr
    while service.status().get("state") != "loading":  # noqa: ASYNC110 - no event for a load starting
        await asyncio.sleep(poll_s)
    started_s = time.monotonic()
    is_tty = stream.isatty()
    print(f"strata: loading {_model_description(service)} ...", file=stream, flush=True)
    last_print_s = started_s
    try:
        while True:
            await asyncio.sleep(poll_s)
            now_s = time.monotonic()
            if now_s - last_print_s < (tick_s if is_tty else 5 * tick_s):
                continue
            last_print_s = now_s
            text = f"strata: loading {service.model_id} ... {now_s - started_s:.0f} s"
            # A terminal gets one line rewritten in place; a log file a line every 5 ticks.
            print(f"\r{text}" if is_tty else text, end="" if is_tty else "\n", file=stream,
                  flush=True)
    finally:
        if is_tty and last_print_s > started_s:
            print(file=stream, flush=True)  # end the rewritten line


def _model_description(service: Any) -> str:
    """MODEL (size on disk, device), as far as the status knows them."""
    parts = []
    path = getattr(service, "model_path", None)
    with contextlib.suppress(OSError, TypeError):
        if path is not None:
            parts.append(format_size(model_size_bytes(Path(path))))
    device = getattr(getattr(service, "settings", None), "device", None)
    if device and device != "auto":
        parts.append(str(device))
    return f"{service.model_id} ({', '.join(parts)})" if parts else str(service.model_id)


def model_size_bytes(path: Path) -> int:
    """A model's size on disk: the file, or the files of a Hugging Face directory."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return path.stat().st_size


def format_size(num_bytes: int) -> str:
    """MiB, or GiB from 1 GiB on: the units the docs and the tray give model sizes in."""
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.1f} GiB"
    return f"{num_bytes / MIB:.0f} MiB"


def _load_failure(service: Any) -> str | None:
    """Why the model could not be loaded at start-up (the engine state is failed), else None.

    Waiting for VRAM is no failure (the state stays unloaded): the server serves and retries.
    """
    status = service.status()
    if status.get("state") != "failed":
        return None
    reason = status.get("last_error") or "the engine failed to start"
    return f"cannot load the model: {reason}"


def _start_rules(host: Host, service: Any, interval_s: float) -> asyncio.Task | None:
    """Run the config's rules on this loop, as the tray does; None when there are none."""
    if not host.config.get("rules"):
        return None
    telemetry = GpuTelemetry()
    rules = host.rules_engine(service, vram_reader=telemetry.read,
                              on_event=lambda event: log.info("rule %s", event.sentence))
    log.info("running %d rule(s) headless%s", len(rules.rules),
             "" if rules.is_enabled else " (turned off in [tray])")
    return asyncio.create_task(rules.run(interval_s), name="strata-rules")
