"""CPU-heavy host work (JSON parsing, chat templates, tokenizing) runs off the event loop.

A 10 MiB body to /tokenize once held the loop for 11 s, and /health with it. The work goes to a
small thread pool instead: the tokenizer (Rust, `encode_batch`) releases the GIL, and Python
code (jinja templates) yields it every few ms, so the loop keeps answering. The pool is bounded
in threads and in waiting jobs, so a flood of huge requests gets a 503, not unbounded memory.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from strata.engine.api.errors import ApiError

MAX_CPU_WORKERS = 2  # the machines Strata runs on share their cores with the engine
MAX_CPU_JOBS = 64  # running plus waiting; past it a request gets 503 with Retry-After
_RETRY_AFTER_S = 1.0
T = TypeVar("T")


@dataclass
class CpuPool:
    """The app's worker threads and how many jobs they hold now."""

    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        max_workers=MAX_CPU_WORKERS, thread_name_prefix="strata-api-cpu"))
    num_jobs: int = 0


CPU_POOL_KEY = web.AppKey("strata_cpu_pool", CpuPool)


async def cpu_pool_context(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the pool lives as long as the app."""
    pool = CpuPool()
    app[CPU_POOL_KEY] = pool
    yield
    pool.executor.shutdown(wait=False, cancel_futures=True)


async def run_cpu(app: web.Application, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on the app's worker threads; 503 when too many jobs are queued."""
    pool = app[CPU_POOL_KEY]
    if pool.num_jobs >= MAX_CPU_JOBS:
        raise ApiError(503, f"the server is busy with {pool.num_jobs} large requests; retry "
                       "shortly", "server_busy", retry_after_s=_RETRY_AFTER_S)
    pool.num_jobs += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(
            pool.executor, functools.partial(fn, *args, **kwargs))
    finally:
        pool.num_jobs -= 1
