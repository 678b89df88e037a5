"""POST /api/pull: Ollama's pull, served from the Hugging Face hub (strata/library/pull.py).

Ollama's own registry is not reachable from here; its names for hub models (`hf.co/OWNER/REPO`
with a quantization tag) and Strata's `OWNER/REPO[:FILE]` are. The transfer runs on a worker
thread; its progress comes back as Ollama's NDJSON lines (`pulling manifest`, `pulling FILE`
with digest/total/completed, `verifying sha256 digest`, `success`). A client that goes away
stops the transfer at its next chunk; every other way a pull ends is an error in Ollama's
shape (a status with `stream: false`, the stream's last line otherwise).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from aiohttp import web

from strata.engine.api.errors import ApiError, bad_request
from strata.engine.api.keys import SERVICE_KEY
from strata.engine.api.request_fields import refuse_unknown_fields
from strata.engine.api.validation import read_json_object
from strata.library.pull import (
    BadListingError,
    DownloadError,
    HubOfflineError,
    PullCancelled,
    PullError,
    PullProgress,
    RepoNotFoundError,
    parse_spec,
    pull,
)
from strata.paths import model_cache_dir

log = logging.getLogger(__name__)
OLLAMA_PULL_FIELDS = frozenset({"model", "name", "insecure", "stream"})
_HUB_HOSTS = ("hf.co/", "huggingface.co/")
# Ollama picks this quantization of an hf.co repo when the name has no tag.
_OLLAMA_DEFAULT_QUANT = "Q4_K_M"
_PROGRESS_INTERVAL_S = 0.1  # a progress line per file at most this often (the last one always)
_EXAMPLE = "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"


@runtime_checkable
class ModelLibrary(Protocol):
    """The model pool's side of a pull: where models go, and a rescan that lists the new one.
    A single-model Service has neither; its pulls go to the model cache."""

    models_dir: Path

    async def rescan(self) -> Any: ...


def hub_spec(name: Any) -> tuple[str, str | None]:
    """(OWNER/REPO[:FILE], preferred quantization) for an Ollama model name; 400 for a name
    of Ollama's registry, which Strata cannot reach."""
    if not isinstance(name, str) or not name.strip():
        raise bad_request("'model' must name a model, e.g. " + _EXAMPLE, param="model")
    name = name.strip()
    host_less = name
    for host in _HUB_HOSTS:
        if name.lower().startswith(host):
            host_less = name[len(host):]
            break
    repo, _, tag = host_less.partition(":")
    tag = "" if tag == "latest" else tag
    if repo.count("/") != 1 or not all(repo.split("/")) or "." in repo.split("/")[0]:
        raise bad_request(f"'{name}' is a name of Ollama's registry, which Strata does not "
                          "pull from; pull a GGUF from the Hugging Face hub instead: "
                          f"hf.co/OWNER/REPO:QUANT or OWNER/REPO[:FILE], e.g. {_EXAMPLE}",
                          param="model")
    spec = f"{repo}:{tag}" if tag else repo
    try:
        parse_spec(spec)  # a repository id the hub refuses: a 400 before the stream starts
    except PullError as exc:
        raise bad_request(str(exc), param="model") from None
    # Ollama's default for a tagless hf.co name; a plain OWNER/REPO keeps Strata's rule
    # (several GGUF files: name one).
    preferred = _OLLAMA_DEFAULT_QUANT if host_less != name and not tag else None
    return spec, preferred


def _parse(body: dict[str, Any]) -> tuple[str, str | None, bool]:
    if body.get("insecure") is True:
        raise bad_request("'insecure' is not supported by /api/pull: the hub is reached over "
                          "TLS; for a plain-HTTP mirror set HF_ENDPOINT", param="insecure")
    refuse_unknown_fields(body, OLLAMA_PULL_FIELDS, "/api/pull")
    is_stream = body.get("stream", True)
    if not isinstance(is_stream, bool):
        raise bad_request("'stream' must be true or false", param="stream")
    spec, preferred = hub_spec(body.get("model") or body.get("name"))
    return spec, preferred, is_stream


def progress_line(report: PullProgress) -> dict[str, Any]:
    """Ollama's progress object for one report."""
    line: dict[str, Any] = {"status": f"pulling {report.file.name}"
                            if report.phase == "downloading" else "verifying sha256 digest"}
    if report.file.sha256:
        line["digest"] = f"sha256:{report.file.sha256}"
    total = report.total_bytes if report.total_bytes is not None else report.file.size_bytes
    if total is not None:
        line["total"] = total
    line["completed"] = report.completed_bytes
    return line


class PullJob:
    """One pull on a worker thread; its progress lines arrive on the loop through a queue."""

    def __init__(self, spec: str, models_dir: Path, preferred: str | None):
        self.spec = spec
        self._loop = asyncio.get_running_loop()
        self._lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._cancel = threading.Event()
        self._last_sent_s: dict[str, float] = {}
        self.task = asyncio.ensure_future(asyncio.to_thread(self._run, models_dir, preferred))
        self.task.add_done_callback(_retrieve)

    def _run(self, models_dir: Path, preferred: str | None) -> Path:
        try:
            return pull(self.spec, models_dir, progress=False, on_progress=self._report,
                        cancel=self._cancel, preferred=preferred)
        finally:
            self._loop.call_soon_threadsafe(self._lines.put_nowait, None)

    def _report(self, report: PullProgress) -> None:
        """On the worker thread: pass the report on, at most every _PROGRESS_INTERVAL_S per
        file except its first, its last and a change of phase."""
        now_s = time.monotonic()
        key = f"{report.phase}:{report.file.name}"
        is_edge = (report.completed_bytes in (0, report.total_bytes)
                   or key not in self._last_sent_s)
        if not is_edge and now_s - self._last_sent_s[key] < _PROGRESS_INTERVAL_S:
            return
        self._last_sent_s[key] = now_s
        self._loop.call_soon_threadsafe(self._lines.put_nowait, progress_line(report))

    async def lines(self) -> AsyncIterator[dict[str, Any]]:
        """Progress lines until the thread ends; then the pull's error, if any, is raised."""
        while (line := await self._lines.get()) is not None:
            yield line
        await self.task

    def cancel(self) -> None:
        """Stop the transfer at its next chunk (a no-op once it has ended)."""
        self._cancel.set()


def _retrieve(task: asyncio.Future) -> None:
    """A pull whose client left ends with PullCancelled that nobody awaits: log, not warn."""
    if not task.cancelled() and task.exception() is not None:
        log.info("pull ended: %s", task.exception())


def _api_error(exc: PullError) -> ApiError:
    """404 no such repository, 503 offline mode, 502 a hub that failed or answered what
    Strata refuses to write, 400 a name that picks no single file."""
    if isinstance(exc, RepoNotFoundError):
        return ApiError(404, str(exc), "model_not_found")
    if isinstance(exc, HubOfflineError):
        return ApiError(503, str(exc), "hub_offline")
    if isinstance(exc, (DownloadError, BadListingError)):
        return ApiError(502, str(exc), "pull_failed")
    return ApiError(400, str(exc), "invalid_request")


async def _after_success(service: Any) -> None:
    """The pool lists the new model (and /api/tags with it). The file is in place whatever
    happens here, and the pool rescans on a name it does not know: a failure is only logged."""
    if not isinstance(service, ModelLibrary):
        return
    try:
        await service.rescan()
    except Exception:
        log.exception("rescan after a pull failed")


async def pull_model(request: web.Request) -> web.StreamResponse:
    """POST /api/pull {"model", "stream"}: NDJSON progress, or the final object."""
    body = await read_json_object(request)
    spec, preferred, is_stream = _parse(body)
    service = request.app[SERVICE_KEY]
    models_dir = service.models_dir if isinstance(service, ModelLibrary) else model_cache_dir()
    job = PullJob(spec, models_dir, preferred)
    try:
        if is_stream:
            return await _stream(request, job, service)
        try:
            async for _ in job.lines():
                pass
        except PullError as exc:
            raise _api_error(exc) from None
        await _after_success(service)
        return web.json_response({"status": "success"})
    finally:
        job.cancel()  # the handler was cancelled (client gone, server stopping): stop too


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected. Only this ends a stream quietly; a
    ConnectionError from the pull itself (huggingface_hub's offline mode is one) is an error."""


async def _stream(request: web.Request, job: PullJob, service: Any) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    try:
        await _write(response, {"status": "pulling manifest"})
        async for line in job.lines():
            await _write(response, line)
        await _after_success(service)
        await _write(response, {"status": "success"})
    except _ClientGone:
        log.info("client went away during the pull of %s; stopped", job.spec)
    except PullCancelled:
        log.info("the pull of %s was cancelled", job.spec)
    except PullError as exc:
        await _write_last(response, {"error": str(exc)})
    except Exception as exc:  # the stream must end with an error line, never a cut
        log.exception("pull of %s failed", job.spec)
        await _write_last(response, {"error": f"the pull failed: {type(exc).__name__}: {exc}"})
    return response


async def _write(response: web.StreamResponse, line: dict[str, Any]) -> None:
    try:
        await response.write(json.dumps(line).encode() + b"\n")
    except ConnectionError:
        raise _ClientGone from None


async def _write_last(response: web.StreamResponse, line: dict[str, Any]) -> None:
    """The error line; a client already gone has nobody to tell."""
    try:
        await _write(response, line)
    except _ClientGone:
        log.info("client went away before the pull's error was sent: %s", line)
