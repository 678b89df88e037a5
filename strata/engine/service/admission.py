"""Admission: which generations and level changes may run now, and who waits in what order.

Up to `parallel` generations run at once (the engine batches them, issue 22); more wait in one
FIFO of at most `max_queue`, past which a request is refused at once (503 with Retry-After)
rather than left to wait for minutes. A level change (load, sleep, a slot save, an idle timer)
runs alone: it waits until the running generations have finished, and generations that arrive
behind it wait for it. One queue for both keeps arrival order fair, as the single lock did.

A waiter whose task is cancelled (its HTTP client went away) leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from strata.engine.service.facade import ServiceError

# Retry-After for a full queue: the queue's expected drain time, within these bounds.
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0
_MEAN_WEIGHT = 0.2  # weight of the newest generation in the running mean of their durations


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future
    request_id: str | None  # None: a level change, which runs alone
    is_queued: bool = field(default=True)
    is_granted: bool = field(default=False)


class AdmissionGate:
    """Generations share the gate (up to `parallel`); level changes hold it alone; FIFO."""

    def __init__(self, parallel: int, max_queue: int,
                 on_change: Callable[[], None] | None = None):
        """on_change: called whenever the running or waiting generations may have changed."""
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, not {parallel}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, not {max_queue}")
        self.parallel = parallel
        self.max_queue = max_queue
        self._running: dict[str, float] = {}  # request id -> monotonic time it was admitted
        self._waiters: deque[_Waiter] = deque()
        self._num_waiting = 0  # generations among the waiters
        self._is_exclusive = False  # a level change holds the gate
        self._mean_duration_s: float | None = None
        self._on_change = on_change or (lambda: None)

    # ---- reading ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Generations admitted and not yet released (bringing the model back counts)."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Generations waiting to be admitted."""
        return self._num_waiting

    @property
    def is_busy(self) -> bool:
        """A generation runs or waits."""
        return bool(self._running) or self._num_waiting > 0

    @property
    def is_in_use(self) -> bool:
        """Anything runs or waits, a level change included."""
        return self.is_busy or self._is_exclusive or bool(self._waiters)

    @property
    def oldest_request_id(self) -> str | None:
        """The generation running longest, or None."""
        return next(iter(self._running), None)

    def retry_after_s(self) -> float:
        """About when a place in the queue frees: its drain time at the mean duration."""
        mean_s = self._mean_duration_s or MIN_RETRY_AFTER_S
        drain_s = mean_s * math.ceil((self._num_waiting + 1) / self.parallel)
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(drain_s)))

    # ---- generations -----------------------------------------------------------------------

    async def admit(self, request_id: str) -> None:
        """Wait for a place among the running generations; the caller must release() it.

        Raises ServiceError 503 queue_full at once when max_queue generations already wait.
        """
        if not self._waiters and self._can_share():
            self._running[request_id] = time.monotonic()
            self._on_change()
            return
        if self._num_waiting >= self.max_queue:
            retry_s = self.retry_after_s()
            raise ServiceError("queue_full", f"the server is busy: {self.num_running} requests run and "
                f"{self._num_waiting} wait (max_queue {self.max_queue}); retry in {retry_s:g} s",
                retry_after_s=retry_s)
        await self._wait(request_id)

    def release(self, request_id: str) -> None:
        """The generation is over: its place goes to the next waiter."""
        admitted_s = self._running.pop(request_id, None)
        if admitted_s is not None:
            duration_s = time.monotonic() - admitted_s
            mean_s = self._mean_duration_s
            self._mean_duration_s = duration_s if mean_s is None else (
                mean_s + _MEAN_WEIGHT * (duration_s - mean_s))
        self._admit_waiters()
        self._on_change()

    # ---- level changes ---------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the gate alone: after the running generations, before the ones behind."""
        if not self._waiters and not self._running and not self._is_exclusive:
            self._is_exclusive = True
        else:
            await self._wait(None)
        try:
            yield
        finally:
            self._is_exclusive = False
            self._admit_waiters()
            self._on_change()

    # ---- queue -----------------------------------------------------------------------------

    def _can_share(self) -> bool:
        return not self._is_exclusive and len(self._running) < self.parallel

    async def _wait(self, request_id: str | None) -> None:
        waiter = _Waiter(asyncio.get_running_loop().create_future(), request_id)
        self._waiters.append(waiter)
        if request_id is not None:
            self._num_waiting += 1
            self._on_change()
        try:
            await waiter.future
        except BaseException:  # cancelled: the client went away, or the server stops
            if waiter.is_queued:
                self._dequeue(waiter)
            elif waiter.is_granted:  # admitted as the cancel landed: give the place back
                if request_id is None:
                    self._is_exclusive = False
                else:
                    self._running.pop(request_id, None)
            self._admit_waiters()
            self._on_change()
            raise

    def _dequeue(self, waiter: _Waiter) -> None:
        waiter.is_queued = False
        self._waiters.remove(waiter)
        if waiter.request_id is not None:
            self._num_waiting -= 1

    def _admit_waiters(self) -> None:
        """Admit from the head of the queue while its head may run (strict arrival order)."""
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():  # cancelled, its task not yet resumed: drop it
                self._dequeue(waiter)
                continue
            if waiter.request_id is None:
                if self._running or self._is_exclusive:
                    return
                self._grant(waiter)
                self._is_exclusive = True
                return
            if not self._can_share():
                return
            self._grant(waiter)
            self._running[waiter.request_id] = time.monotonic()

    def _grant(self, waiter: _Waiter) -> None:
        self._dequeue(waiter)
        waiter.is_granted = True
        waiter.future.set_result(None)
