"""A local stand-in for the Hugging Face hub: the routes huggingface_hub calls to list a model's
files and download them (model info with file metadata, HEAD and ranged GET of resolve URLs,
answered as the hub's CDN answers them: 206 with Content-Range, 416 past the end)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiohttp import web

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    """repos: repo id -> {file name: bytes}. corrupt: file names served with other bytes than
    the hash the listing advertises. requests: (method, path) of every request.
    chunk_bytes/chunk_delay_s: send downloads in pieces with a pause between, as a slow link
    does, so a test can stop a pull halfway. drop_after_bytes: {file name: n}: the next GET of
    that file breaks its connection after n bytes of body (once). ranges: (file name, Range
    header or None) of every GET; served_bytes: body bytes sent per file name. commit: what
    the listing calls its commit. any_path_bytes: a hostile mirror's answer to a GET of any path
    it does not know (a listed '../x.gguf' arrives as the URL's normalized path)."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    corrupt: set[str] = field(default_factory=set)
    requests: list[tuple[str, str]] = field(default_factory=list)
    chunk_bytes: int = 0
    chunk_delay_s: float = 0.0
    num_aborted: int = 0  # downloads the client broke off
    drop_after_bytes: dict[str, int] = field(default_factory=dict)
    ranges: list[tuple[str, str | None]] = field(default_factory=list)
    served_bytes: dict[str, int] = field(default_factory=dict)
    honours_ranges: bool = True  # False: a Range header is ignored (200, the whole file)
    is_broken: bool = False  # True: every GET's connection breaks before a byte of the body
    commit: str = COMMIT
    any_path_bytes: bytes | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/models/{owner}/{repo}", self.model_info)
        app.router.add_get("/api/models/{owner}/{repo}/revision/{rev}", self.model_info)
        app.router.add_get("/{owner}/{repo}/resolve/{rev}/{name:.+}", self.resolve)
        app.router.add_get("/{path:.*}", self.any_path)
        return app

    async def any_path(self, request: web.Request) -> web.Response:
        self.requests.append((request.method, request.path))
        if self.any_path_bytes is None:
            raise web.HTTPNotFound()
        return web.Response(body=self.any_path_bytes)

    def _files(self, request: web.Request) -> tuple[str, dict[str, bytes]]:
        self.requests.append((request.method, request.path))
        repo = f"{request.match_info['owner']}/{request.match_info['repo']}"
        if repo not in self.repos:
            raise web.HTTPNotFound(headers={"X-Error-Code": "RepoNotFound"},
                                   text='{"error": "Repository not found"}')
        return repo, self.repos[repo]

    async def model_info(self, request: web.Request) -> web.Response:
        repo, files = self._files(request)
        siblings = [{"rfilename": name, "size": len(data),
                     "blobId": hashlib.sha1(data).hexdigest(),
                     "lfs": {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                             "pointerSize": 134}}
                    for name, data in files.items()]
        return web.json_response({"_id": repo, "id": repo, "modelId": repo, "sha": self.commit,
                                  "private": False, "siblings": siblings})

    async def resolve(self, request: web.Request) -> web.StreamResponse:
        _, files = self._files(request)
        name = request.match_info["name"]
        data = files.get(name, self.any_path_bytes)
        if data is None:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"})
        headers = {"X-Repo-Commit": self.commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Accept-Ranges": "bytes"}
        if name in self.corrupt:
            data = bytes(reversed(data))
        status = 200
        if request.method == "GET":
            self.ranges.append((name, request.headers.get("Range")))
        if request.method == "GET" and self.honours_ranges and \
                request.http_range.start is not None:
            start = request.http_range.start
            if start >= len(data):
                raise web.HTTPRequestRangeNotSatisfiable(
                    headers={"Content-Range": f"bytes */{len(data)}"})
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            data, status = data[start:], 206
        if request.method != "GET":
            return web.Response(body=data, status=status, headers=headers)
        drop_at = 0 if self.is_broken else self.drop_after_bytes.pop(name, None)
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = len(data)
        await response.prepare(request)
        step = self.chunk_bytes or len(data) or 1
        try:
            for offset in range(0, len(data), step):
                piece = data[offset:offset + step]
                if drop_at is not None and offset + len(piece) >= drop_at:
                    await self._drop(request, response, name, piece[:drop_at - offset])
                    return response
                await response.write(piece)
                self.served_bytes[name] = self.served_bytes.get(name, 0) + len(piece)
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
        except (ConnectionError, asyncio.CancelledError):
            self.num_aborted += 1
            raise
        await response.write_eof()
        return response

    async def _drop(self, request: web.Request, response: web.StreamResponse, name: str,
                    piece: bytes) -> None:
        """Send piece, then cut the connection mid-body, as a network failure does."""
        await response.write(piece)
        self.served_bytes[name] = self.served_bytes.get(name, 0) + len(piece)
        assert request.transport is not None
        request.transport.close()  # flushes what was written, then closes: the body stops short


@contextlib.contextmanager
def hub_in_thread(hub: FakeHub) -> Iterator[str]:
    """Serve hub on 127.0.0.1 from a thread with its own loop, for tests without one (Qt);
    yields the endpoint URL (for HF_ENDPOINT)."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(hub.app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, name="fake-hub", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
