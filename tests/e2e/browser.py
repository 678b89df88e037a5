"""A real headless Chromium opening a page that calls Strata with fetch(), for CORS tests.

The page is served by a small aiohttp server on the test's loop; it runs its fetch and posts
what it saw (status, streamed body, or the error) back to that server's /report, so the test
waits for the report instead of guessing when the page is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aiohttp import web

_BROWSERS = ("chromium", "chromium-browser", "google-chrome")

PAGE = """<!doctype html><html><body><script>
async function run() {
  const target = new URLSearchParams(location.search).get("target");
  const result = {origin: location.origin};
  try {
    const response = await fetch(target + "/v1/chat/completions", {
      method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({messages: [{role: "user", content: "Say hello."}],
                            max_tokens: 8, temperature: 0, stream: true})});
    result.status = response.status;
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let body = "", reads = 0;
    for (;;) {
      const {done, value} = await reader.read();
      if (done) break;
      reads += 1;
      body += decoder.decode(value, {stream: true});
    }
    result.reads = reads;
    result.body = body;
  } catch (error) {
    result.error = String(error);
  }
  await fetch("/report", {method: "POST", body: JSON.stringify(result)});
}
run();
</script></body></html>
"""


def find_browser() -> str | None:
    """The Chromium executable on PATH, if any."""
    return next((path for name in _BROWSERS if (path := shutil.which(name))), None)


@contextlib.asynccontextmanager
async def page_server(hosts: tuple[str, ...]) -> AsyncIterator[tuple[dict[str, int], asyncio.Queue]]:
    """Serve PAGE on each host (its own free port); yield ({host: port}, reports queue)."""
    reports: asyncio.Queue = asyncio.Queue()

    async def page(_: web.Request) -> web.Response:
        return web.Response(text=PAGE, content_type="text/html")

    async def report(request: web.Request) -> web.Response:
        await reports.put(json.loads(await request.text()))
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/page.html", page)
    app.router.add_post("/report", report)
    runner = web.AppRunner(app)
    await runner.setup()
    ports = {}
    try:
        for host in hosts:
            site = web.TCPSite(runner, host, 0)
            await site.start()
            ports[host] = site._server.sockets[0].getsockname()[1]
        yield ports, reports
    finally:
        await runner.cleanup()


async def open_page(browser: str, url: str, reports: asyncio.Queue, profile_dir: Path,
                    timeout_s: float = 120.0) -> dict[str, Any]:
    """Open url in headless Chromium until the page reports; return its report."""
    process = await asyncio.create_subprocess_exec(
        browser, "--headless", "--no-sandbox", "--disable-gpu",
        "--disable-background-networking", "--disable-component-update", "--no-first-run",
        f"--user-data-dir={profile_dir}", url,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True)
    try:
        return await asyncio.wait_for(reports.get(), timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)  # its own session: the renderer goes too
        await asyncio.wait_for(process.wait(), 10)
