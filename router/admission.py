"""Admission control: at most `limit` requests in flight (0 = unlimited); up to `max_queued`
more wait for a slot, in (priority, arrival) order as the engines' priority policy (lower
first), for at most `timeout` seconds. A freed slot passes straight to the first waiter, so
a newcomer never overtakes the queue."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

RETRY_AFTER_S = 1  # the hint a refused client gets (whole seconds, as HTTP Retry-After)


class Rejected(Exception):
    """No slot; `reason` is queue_full or queue_timeout, the message names the limit."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{message}; retry after ~{RETRY_AFTER_S} s")
        self.reason = reason


class Admission:
    def __init__(self, limit: int, max_queued: int, timeout: float) -> None:
        self.limit = limit
        self.max_queued = max_queued
        self.timeout = timeout
        self.in_flight = 0
        self._queue: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap
        self._arrivals = itertools.count()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def acquire(self, priority: int = 0) -> Callable[..., None]:
        """Take a slot, waiting in line (by priority, then arrival) if need be; returns its
        release (idempotent, any arguments ignored, so it can be a done callback). Raises
        Rejected."""
        if not self.limit or (self.in_flight < self.limit and not self._queue):
            self.in_flight += 1
        elif len(self._queue) >= self.max_queued:
            raise Rejected("queue_full", f"router at --max-concurrent-requests={self.limit} "
                                         f"with {len(self._queue)} queued "
                                         f"(--max-queued-requests={self.max_queued})")
        else:
            await self._wait_turn(priority)
        released = False

        def release(*_: object) -> None:
            nonlocal released
            if not released:
                released = True
                self._release()

        return release

    async def _wait_turn(self, priority: int) -> None:
        """Wait until a release hands this request its slot (then in_flight counts it)."""
        waiter = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._arrivals), waiter)
        heapq.heappush(self._queue, entry)
        try:
            await asyncio.wait((waiter,), timeout=self.timeout)
        except asyncio.CancelledError:
            if waiter.done():
                self._release()  # the slot came as the client left: pass it on
            else:
                self._leave(entry)
            raise
        if not waiter.done():
            self._leave(entry)
            raise Rejected("queue_timeout", f"no --max-concurrent-requests={self.limit} slot "
                                            f"within --queue-timeout={self.timeout:g} s "
                                            f"({len(self._queue)} queued)")

    def _leave(self, entry: tuple[int, int, asyncio.Future[None]]) -> None:
        self._queue.remove(entry)
        heapq.heapify(self._queue)

    def _release(self) -> None:
        if self._queue:  # the slot passes to the first waiter (which leaves the queue)
            heapq.heappop(self._queue)[2].set_result(None)
        else:
            self.in_flight -= 1
