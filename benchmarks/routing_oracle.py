"""The `oracle` route of `nanoserve bench routing`: routing on the engines' exact cache
contents, the reference a cache-aware router's hit rate is measured against.

For each turn it reads every engine's TRUE prefix cache at that moment (SubscribeKvEvents
starts with a snapshot of the engine's cached block hashes: open, read that batch, cancel)
and its load (GetLoad), then streams the turn straight to the engine holding the longest
cached prefix of the prompt; ties go to the fewest tokens in flight, then the lowest index.
No router is involved, so nothing is stale or guessed. It is not an upper bound: it weighs
no load against a cached prefix, so it piles a tenant's turns onto one engine, whose LRU
then evicts; a router that spreads load can keep more of the workload cached.

Prompt hashes and matching are the router's own (engine_service.common.block_hash and
router.prefix_index), so "cached prefix" means what the engines and the router mean by it.
TTFT is timed from the send, after the decision: reading every engine per turn is the
benchmark's own cost, not a router's.

Torch-free: gRPC only.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc

from benchmarks.routing_senders import Reply, Send, grpc_sender
from engine_service.common.block_hash import HASH_SCHEME, hash_prompt_blocks
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from router.prefix_index import PrefixIndex


@dataclass
class EngineView:
    """One engine at one moment: its cache snapshot and its load."""

    hashes: list[int]  # every cached block hash
    block_size: int    # tokens per block the hashes were made with
    tokens_in_flight: int


def choose(prompt: list[int], views: list[EngineView]) -> tuple[int, int]:
    """(index of the engine to send `prompt` to, its cached prompt tokens): longest cached
    prefix, then least tokens in flight, then lowest index."""
    index = PrefixIndex()
    hashes: dict[int, list[int]] = {}  # block size -> the prompt's block hashes
    cached = []
    for i, view in enumerate(views):
        key = str(i)
        index.apply_snapshot(key, 0, view.hashes)
        if view.block_size not in hashes:
            hashes[view.block_size] = hash_prompt_blocks(prompt, view.block_size)
        cached.append(index.match(key, hashes[view.block_size]) * view.block_size)
    best = min(range(len(views)), key=lambda i: (-cached[i], views[i].tokens_in_flight, i))
    return best, cached[best]


class Oracle:
    """Open with `async with Oracle(targets, ...)`; `send` is the route's Send."""

    def __init__(self, targets: list[str], max_tokens: int, timeout: float) -> None:
        self.targets = targets
        self.max_tokens = max_tokens
        self.timeout = timeout
        self._stack = contextlib.AsyncExitStack()
        self._stubs: list[pb_grpc.EngineStub] = []
        self._senders: list[Send] = []
        self._block_sizes: list[int] = []  # from GetModelInfo, for snapshots that omit it

    async def __aenter__(self) -> Oracle:
        from clients import AsyncClient

        for target in self.targets:
            channel = await self._stack.enter_async_context(grpc.aio.insecure_channel(target))
            stub = pb_grpc.EngineStub(channel)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            if info.hash_scheme != HASH_SCHEME:
                raise RuntimeError(f"engine {target} hashes blocks with {info.hash_scheme!r}, "
                                   f"this benchmark with {HASH_SCHEME!r}")
            client = await self._stack.enter_async_context(AsyncClient(target))
            self._stubs.append(stub)
            self._block_sizes.append(info.kv_block_size)
            self._senders.append(grpc_sender(client, self.max_tokens, self.timeout))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def view(self, i: int) -> EngineView:
        snapshot, load = await asyncio.gather(self._snapshot(i), self._stubs[i].GetLoad(
            pb.GetLoadRequest(), timeout=self.timeout))
        return EngineView(list(snapshot.block_hashes_stored),
                          snapshot.kv_block_size or self._block_sizes[i], load.tokens_in_flight)

    async def _snapshot(self, i: int) -> pb.KvEventBatch:
        call = self._stubs[i].SubscribeKvEvents(
            pb.SubscribeKvEventsRequest(after_sequence_number=0), timeout=self.timeout)
        try:
            batch = await call.read()
        finally:
            call.cancel()
        if batch is grpc.aio.EOF or not batch.snapshot:
            raise RuntimeError(f"engine {self.targets[i]} did not start its KV events with a "
                               "snapshot")
        return batch

    async def send(self, prompt: list[int]) -> Reply:
        views = await asyncio.gather(*(self.view(i) for i in range(len(self.targets))))
        best, _ = choose(prompt, views)
        return await self._senders[best](prompt)
