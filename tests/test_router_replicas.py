"""Router replicas agree with no router-to-router traffic (issue 37, "Replicas agree").

Several routers over the same fake engines (tests/fake_engine.py: KV events pushed at
admission, GetLoad computed from the requests running, as a real engine's frontend does
per step) each rebuild their view from the engines alone: the KV-event stream (a snapshot,
then deltas) for what each engine caches, GetLoad every --load-interval for what it runs.
So a prefix warmed through one replica routes to the same engine through any other, load
sent through one replica shows up in the others' figures within one load poll, and a
router killed and restarted on its port routes a cached prefix home as soon as it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.client import build_request
from engine_service.common.block_hash import hash_prompt_blocks
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.server import Router
from tests.fake_engine import FakeBehavior, FakeEngine
from tests.procs import start_router
from tests.router_helpers import wait_ready

BLOCK = 4  # the fakes' kv_block_size
DEFAULTS = RouterConfig(engine=["127.0.0.1:1"])  # the routers' cadence as shipped
# KV events are pushed: a replica hears of a block within milliseconds. Load is polled:
# another replica's request shows within one --load-interval plus one GetLoad round trip.
KV_PROPAGATION_S = 0.5
LOAD_PROPAGATION_S = DEFAULTS.load_interval + 0.3


class HoldingFake(FakeEngine):
    """A fake engine that keeps requests whose id starts with "hold-" in flight after their
    first chunk until `release` is set (or the client goes away)."""

    def __init__(self, engine_id: str, behavior: FakeBehavior) -> None:
        super().__init__(engine_id, behavior)
        self.release = threading.Event()
        self.snapshot_delay = 0.0  # seconds a KV subscription waits before its first batch

    def SubscribeKvEvents(self, request, context):
        time.sleep(self.snapshot_delay)
        yield from super().SubscribeKvEvents(request, context)

    def Stream(self, request, context):
        for chunk in super().Stream(request, context):
            yield chunk
            while (request.request_id.startswith("hold-") and not self.release.is_set()
                   and context.is_active()):
                self.release.wait(0.02)


def start_fakes(n: int) -> list[HoldingFake]:
    fakes = []
    for i in range(n):
        fake = HoldingFake(f"e{i}", FakeBehavior(kv_block_size=BLOCK))
        fake.start("127.0.0.1", 0)
        fakes.append(fake)
    return fakes


def targets(fakes: list[HoldingFake]) -> list[str]:
    return [f"127.0.0.1:{f.port}" for f in fakes]


async def until(predicate: Callable[[], bool], timeout: float) -> float:
    """Seconds until predicate() held; AssertionError after `timeout`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while not predicate():
        if loop.time() - start > timeout:
            raise AssertionError(f"condition not reached within {timeout:.2f} s")
        await asyncio.sleep(0.005)
    return loop.time() - start


@contextlib.asynccontextmanager
async def replicas(fakes: list[HoldingFake], n: int = 3):
    """`n` in-process routers with the shipped cadence over the same engines, each ready
    (every engine routable, its KV snapshot in); yields (router, stub) pairs."""
    routers = [Router(RouterConfig(engine=targets(fakes), port=0, http_port=None, seed=i))
               for i in range(n)]
    async with contextlib.AsyncExitStack() as stack:
        for router in routers:
            stack.push_async_callback(router.stop, 0)
            await router.start()
        for router in routers:
            assert await wait_ready(router.pool, len(fakes), timeout=10)
        stubs = []
        for router in routers:
            channel = await stack.enter_async_context(
                grpc.aio.insecure_channel(f"127.0.0.1:{router.port}"))
            stubs.append(pb_grpc.GenerationStub(channel))
        yield list(zip(routers, stubs, strict=True))


async def served_by(stub: pb_grpc.GenerationStub, prompt: list[int], **kw) -> str:
    """The engine id that served the whole stream (one engine, no failover)."""
    chunks = [c async for c in stub.Stream(build_request(prompt, max_tokens=2, **kw),
                                           timeout=10)]
    engine_ids = {c.engine_id for c in chunks}
    assert len(engine_ids) == 1, engine_ids
    return engine_ids.pop()


def routed(router: Router, engine: str, reason: str) -> float:
    value = router.metrics.registry.get_sample_value(
        "nanoserve_router_requests_total", {"engine": engine, "reason": reason})
    return value or 0.0


def aio(fn):
    def wrapper():
        asyncio.run(fn())
    wrapper.__name__ = fn.__name__
    return wrapper


@aio
async def test_a_prefix_warmed_through_one_replica_routes_home_through_every_replica():
    fakes = start_fakes(3)
    try:
        async with replicas(fakes) as ((a, stub_a), *others):
            for n, prefix in enumerate([list(range(10, 42)), list(range(200, 248))]):
                home = await served_by(stub_a, prefix + [1, 2])
                key = targets(fakes)[int(home[1:])]
                hashes = hash_prompt_blocks(prefix, BLOCK)
                for router, _ in others:  # only the engine's KV events can tell them
                    await until(lambda r=router, k=key, h=hashes: r.index.match(k, h) == len(h),
                                KV_PROPAGATION_S)
                for router, stub in others:
                    hits = routed(router, key, "prefix_hit")
                    assert await served_by(stub, prefix + [3 + n, 4]) == home
                    # chosen for the prefix it knew, not by a lucky tie among idle engines
                    assert routed(router, key, "prefix_hit") == hits + 1
                # the same prompt, through every replica: one decision
                same = [await served_by(stub, prefix + [9, 9]) for _, stub in [(a, stub_a),
                                                                                *others]]
                assert same == [home] * 3
    finally:
        for fake in fakes:
            fake.stop(0)


@aio
async def test_load_sent_through_one_replica_reaches_the_others_through_the_engines():
    fakes = start_fakes(2)
    try:
        async with replicas(fakes) as ((a, stub_a), *others):
            held = stub_a.Stream(build_request(list(range(10, 30)), max_tokens=800,
                                               request_id="hold-1"), timeout=20)
            first = await held.read()  # in flight on its engine from here on
            busy = targets(fakes)[int(first.engine_id[1:])]
            idle = next(t for t in targets(fakes) if t != busy)
            for router, _ in others:  # GetLoad is the only way they can know
                waited = await until(
                    lambda r=router: (r.metrics.registry.get_sample_value(
                        "nanoserve_router_engine_load_tokens", {"engine": busy}) or 0) >= 799,
                    LOAD_PROPAGATION_S)
                assert waited <= LOAD_PROPAGATION_S
            for i, (router, stub) in enumerate(others):
                # new prompts, cached nowhere: the cost is the load, so the idle engine wins
                for j in range(3):
                    engine = await served_by(stub, [700 + 10 * i + j] * 6)
                    assert targets(fakes)[int(engine[1:])] == idle
                assert routed(router, idle, "prefix_miss") == 3
                assert routed(router, busy, "prefix_miss") == 0
            for fake in fakes:
                fake.release.set()
            chunks = [first]
            while (chunk := await held.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
            assert sum(len(c.token_ids) for c in chunks) == 800
    finally:
        for fake in fakes:
            fake.stop(0)


def router_health(target: str) -> str:
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=0.5)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def stream_engine(target: str, prompt: list[int], **kw) -> pb.GenerateChunk:
    """The last chunk of a 2-token stream through `target` (engine id and usage)."""
    with grpc.insecure_channel(target) as channel:
        chunks = list(pb_grpc.GenerationStub(channel).Stream(
            build_request(prompt, max_tokens=2, **kw), timeout=10))
    assert len({c.engine_id for c in chunks}) == 1
    return chunks[-1]


@pytest.mark.parametrize("snapshot_delay", [0.0, 0.8])
def test_router_killed_mid_run_routes_a_cached_prefix_home_within_a_second_of_serving(
        snapshot_delay: float):
    """With the snapshots slower than the router's health pass too: it turns SERVING only
    once one is in, never routing by load alone."""
    fakes = start_fakes(3)
    for fake in fakes:
        fake.snapshot_delay = snapshot_delay
    router = start_router(targets(fakes), "--http-port", "0", "--log-level", "debug")
    restarted = None
    try:
        deadline = time.monotonic() + 10
        while router_health(router.target) != "SERVING":
            assert time.monotonic() < deadline, router.output()[-3000:]
            time.sleep(0.02)
        prefix = list(range(300, 364))
        home = stream_engine(router.target, prefix + [1, 2]).engine_id
        # mid-run: a stream in flight through the router when it dies
        with grpc.insecure_channel(router.target) as channel:
            held = pb_grpc.GenerationStub(channel).Stream(
                build_request([5] * 8, max_tokens=50, request_id="hold-kill"), timeout=20)
            next(held)
            os.killpg(router.proc.pid, signal.SIGKILL)
            router.proc.wait(10)
        # the same command on the same port; it knows nothing but what the engines tell it
        restarted = router.restarted()
        restarted.wait_for("router listening on", timeout=30)
        assert restarted.port == router.port
        while (status := router_health(restarted.target)) != "SERVING":
            assert restarted.proc.poll() is None, restarted.output()[-3000:]
            time.sleep(0.005)
        serving_at = time.monotonic()
        last = stream_engine(restarted.target, prefix + [3, 4])
        took = time.monotonic() - serving_at
        assert status == "SERVING" and took < 1.0, took
        assert last.engine_id == home
        assert last.usage.cached_prompt_tokens == len(prefix)  # the engine confirms it
        key = targets(fakes)[int(home[1:])]
        restarted.wait_for("reason=", timeout=5)
        assert re.search(rf"engine={re.escape(key)} reason=prefix_hit prompt_tokens=66 "
                         rf"matched_tokens={len(prefix)}", restarted.output()), \
            restarted.output()[-3000:]
    finally:
        for proc in (restarted, router):
            if proc is not None:
                proc.stop(signal.SIGKILL)
        for fake in fakes:
            fake.stop(0)
