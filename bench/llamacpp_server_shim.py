"""Stands in for `llama-server` so llama.cpp's server tests start a real `strata serve`.

Run by bench/llamacpp_server_suite.py (through LLAMA_SERVER_BIN_PATH), never by hand. It maps
the llama-server flags that utils.py's ServerProcess passes to `strata serve` flags and
ignores the ones that only tune llama.cpp (threads, batch sizes, --jinja...). Flags that
change what the server does and have no Strata counterpart (--lora, a draft model,
--chat-template...) are dropped too: the tests that need them are classified as not
model-agnostic in llamacpp_server_suite.py, and they fail on their own if they run.

With LLAMACPP_SHIM_POOL=DIR (the suite's default) one `strata serve` per distinct flag set is
started once, detached, and this process only forwards its test port to it; the suite stops
the pooled servers at the end. Without it, each test start runs its own `strata serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".local/share/strata/models/SmolLM2-135M-Instruct.Q4_1.gguf"
HEALTH_TIMEOUT_S = 120.0
MAX_POOLED = 4  # pooled servers kept running; the least recently used one goes first


def llama_server_args(argv: list[str]) -> argparse.Namespace:
    """The llama-server flags ServerProcess.start() passes; unknown ones are kept aside."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--temp", type=float)
    p.add_argument("--model")
    p.add_argument("--alias")
    p.add_argument("--ctx-size", type=int)
    p.add_argument("--parallel", type=int)
    p.add_argument("--api-key")
    p.add_argument("--cors-origins")
    p.add_argument("--sleep-idle-seconds", type=int)
    p.add_argument("--kv-unified", action="store_true")
    p.add_argument("--seed", type=int)
    p.add_argument("--metrics", action="store_true")
    p.add_argument("--no-slots", action="store_true")
    p.add_argument("--n-predict", type=int)
    p.add_argument("--pooling")
    args, _ignored = p.parse_known_args(argv)
    return args


def strata_args(args: argparse.Namespace, port: int, home: Path,
                host: str = "127.0.0.1") -> list[str]:
    """`strata serve` flags equivalent to the llama-server ones that matter to the tests."""
    model = args.model if args.model and Path(args.model).is_file() else os.environ.get(
        "LLAMACPP_SHIM_MODEL", str(DEFAULT_MODEL))
    models_dir = home / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    out = ["serve", "--model", model, "--models-dir", str(models_dir), "--host", host,
           "--port", str(port), "--device", "cpu", "--no-persist-sessions",
           "--snapshot-dir", str(home / "snapshots")]
    if args.temp is not None:
        out += ["--temperature", str(args.temp)]
    if args.alias:
        out += ["--alias", args.alias]
    if args.ctx_size:
        # llama-server splits --ctx-size among its --parallel slots (unless --kv-unified);
        # each of Strata's slots has the whole --context, so give it one slot's share.
        share = 1 if args.kv_unified or not args.parallel else args.parallel
        out += ["--context", str(args.ctx_size // share)]
    if args.parallel:
        out += ["--slots", str(args.parallel)]
    # llama-server's -1 (its default) is a random seed / no limit: Strata's unset.
    if args.seed is not None and 0 <= args.seed < 0xFFFFFFFF:
        out += ["--seed", str(args.seed)]
    if args.n_predict is not None and args.n_predict > 0:
        out += ["--max-tokens", str(args.n_predict)]
    if args.api_key:
        out += ["--api-key", args.api_key]
    # llama-server allows any origin unless told otherwise ('*', Strata's '*'); "localhost" is
    # its word for the local origins, Strata's own default.
    cors_origins = args.cors_origins or "*"
    if cors_origins != "localhost":
        out += ["--allowed-origins", cors_origins]
    # llama-server serves /metrics only with --metrics, /slots unless --no-slots.
    if not args.metrics:
        out += ["--no-metrics-endpoint"]
    if args.no_slots:
        out += ["--no-slots-endpoint"]
    # --pooling: Strata's own choices (llama-server's rank is for rerankers, left out).
    if args.pooling in ("last", "mean", "none"):
        out += ["--pooling", args.pooling]
    if args.sleep_idle_seconds:
        out += ["--sleep-idle", str(args.sleep_idle_seconds)]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _is_healthy(port: int, api_key: str | None) -> bool:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/health")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _strata_command() -> list[str]:
    # `strata serve` from this checkout: the suite puts it on PYTHONPATH.
    return [sys.executable, "-c", "import sys; from strata.cli import main; sys.exit(main())"]


def pooled_port(args: argparse.Namespace, pool: Path) -> int:
    """The port of the pooled `strata serve` for these flags, started if not running."""
    key_args = strata_args(args, 0, pool / "home")
    key = hashlib.sha256(json.dumps(key_args).encode()).hexdigest()[:16]
    pool.mkdir(parents=True, exist_ok=True)
    with open(pool / "pool.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = pool / f"{key}.json"
        if record.exists():
            known = json.loads(record.read_text())
            if _is_healthy(known["port"], args.api_key):
                record.touch()
                return int(known["port"])
            _stop(record)
        for old in sorted(pool.glob("*.json"), key=lambda r: r.stat().st_mtime)[:-MAX_POOLED + 1]:
            _stop(old)
        port = _free_port()
        home = pool / f"home-{key}"
        with open(pool / f"{key}.log", "ab") as log:
            proc = subprocess.Popen([*_strata_command(), *strata_args(args, port, home)],
                                    stdout=log, stderr=log, start_new_session=True,
                                    env={**os.environ, "STRATA_HOME": str(home)})
        record.write_text(json.dumps({"pid": proc.pid, "port": port, "args": key_args}))
        deadline = time.monotonic() + HEALTH_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if _is_healthy(port, args.api_key):
                return port
            time.sleep(0.1)
        raise SystemExit(f"pooled strata serve did not start; see {pool / f'{key}.log'}")


def _stop(record: Path) -> None:
    """Stop a pooled server (its own process group) and forget it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(json.loads(record.read_text())["pid"], signal.SIGTERM)
    record.unlink()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def forward(host: str, port: int, target_port: int) -> None:
    """Forward every connection on host:port to 127.0.0.1:target_port until SIGTERM."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    # Every address of llama-server's comma list, as `strata serve --host` binds them.
    server = await asyncio.start_server(handle, host.split(","), port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def main(argv: list[str]) -> int:
    args = llama_server_args(argv)
    pool = os.environ.get("LLAMACPP_SHIM_POOL")
    if pool:
        target = pooled_port(args, Path(pool))
        asyncio.run(forward(args.host, args.port, target))
        return 0
    home = Path(os.environ.get("LLAMACPP_SHIM_HOME", "tmp/strata-home"))
    command = [*_strata_command(), *strata_args(args, args.port, home, args.host)]
    os.environ["STRATA_HOME"] = str(home)
    os.execv(command[0], command)  # SIGTERM from the test reaches strata itself


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
