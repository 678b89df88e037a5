"""`strata serve`'s serve() on the test's event loop, for tests that talk HTTP to a Service."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from strata.host.serve import serve


@contextlib.asynccontextmanager
async def serving(settings, service, start_timeout_s: float = 120.0,
                  stop_timeout_s: float = 60.0) -> AsyncIterator[str]:
    """Run serve(settings, service) until the block ends; yields the base URL (no /v1).
    Fails if it is not listening within start_timeout_s, or not stopped with exit code 0
    within stop_timeout_s."""
    stop, urls = asyncio.Event(), []
    task = asyncio.create_task(serve(settings, service=service, stop_event=stop,
                                     on_listening=urls.append))
    for _ in range(round(start_timeout_s / 0.05)):
        if urls or task.done():
            break
        await asyncio.sleep(0.05)
    assert urls, "the server did not start"
    try:
        yield urls[0].removesuffix("/v1")
    finally:
        stop.set()
        assert await asyncio.wait_for(task, stop_timeout_s) == 0
