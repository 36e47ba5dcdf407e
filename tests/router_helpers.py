"""Torch-free test helpers that read a router's engine pool and prefix index."""

from __future__ import annotations

import asyncio
import time

from router.engine_pool import EnginePool
from router.prefix_index import PrefixIndex


async def wait_ready(pool: EnginePool, num_engines: int = 1, timeout: float = 10.0) -> bool:
    """Wait until `num_engines` engines are routable and their KV snapshot is in."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = [e for e in pool.routable() if pool.index.has_snapshot(e.key)]
        if len(ready) >= num_engines:
            return True
        await asyncio.sleep(0.02)
    return False


def index_counts(index: PrefixIndex, engine: str) -> tuple[int, int]:
    """(confirmed, optimistic) block-hash counts the index holds for `engine`."""
    entry = index._engines.get(engine)
    return (0, 0) if entry is None else (len(entry.confirmed), len(entry.optimistic))
