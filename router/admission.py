"""Admission control: at most `limit` requests in flight (0 = unlimited); up to `max_queued`
more wait for a slot, first come first served, for at most `timeout` seconds. A freed slot
passes straight to the oldest waiter, so a newcomer never overtakes the queue."""

from __future__ import annotations

import asyncio
from collections import deque
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
        self._queue: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def acquire(self) -> Callable[..., None]:
        """Take a slot, waiting in line if need be; returns its release (idempotent, any
        arguments ignored, so it can be a done callback). Raises Rejected."""
        if not self.limit or (self.in_flight < self.limit and not self._queue):
            self.in_flight += 1
        elif len(self._queue) >= self.max_queued:
            raise Rejected("queue_full", f"router at --max-concurrent-requests={self.limit} "
                                         f"with {len(self._queue)} queued "
                                         f"(--max-queued-requests={self.max_queued})")
        else:
            await self._wait_turn()
        released = False

        def release(*_: object) -> None:
            nonlocal released
            if not released:
                released = True
                self._release()

        return release

    async def _wait_turn(self) -> None:
        """Wait until a release hands this request its slot (then in_flight counts it)."""
        waiter = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        try:
            await asyncio.wait((waiter,), timeout=self.timeout)
        except asyncio.CancelledError:
            if waiter.done():
                self._release()  # the slot came as the client left: pass it on
            else:
                self._queue.remove(waiter)
            raise
        if not waiter.done():
            self._queue.remove(waiter)
            raise Rejected("queue_timeout", f"no --max-concurrent-requests={self.limit} slot "
                                            f"within --queue-timeout={self.timeout:g} s "
                                            f"({len(self._queue)} queued)")

    def _release(self) -> None:
        if self._queue:  # the slot passes to the oldest waiter (which leaves the queue)
            self._queue.popleft().set_result(None)
        else:
            self.in_flight -= 1
