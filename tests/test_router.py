"""The router against fake engines on loopback (tests/fake_engine.py).

The fakes are deterministic: each next token is the previous token + 1 (mod vocab), whatever
the sampling parameters, so every expected token list below is plain arithmetic on the prompt,
and a stream continued from "prompt + tokens so far" must equal one uninterrupted stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from clients.client import build_request
from engine_service.common.block_hash import hash_prompt_blocks
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.engine_pool import EngineClient, resolve_dns
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex
from router.server import Router, continuation_request, held_back_text
from tests.fake_engine import FakeBehavior, FakeEngine
from tests.router_helpers import index_counts, wait_ready

BLOCK = 4           # the fakes' kv_block_size
VOCAB = 1000        # the fakes' vocab_size
HOT = list(range(100, 164))  # a 64-token shared prefix (16 full blocks)


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + i) % VOCAB for i in range(1, n + 1)]


def aio(fn):
    """Run an async test function in a fresh event loop."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        asyncio.run(fn(*args, **kwargs))
    return wrapper


class RecordingFake(FakeEngine):
    """The shared fake engine, plus: which after_sequence_number each KV subscription asked
    for, and an optional hash scheme to report."""

    def __init__(self, engine_id: str, behavior: FakeBehavior) -> None:
        super().__init__(engine_id, behavior)
        self.subscriptions: list[int] = []
        self.hash_scheme: str | None = None
        self.kv_muted = False  # True: the cache fills but no KV event goes out
        self.deadlines: list[float | None] = []  # time_remaining() of each Stream call

    def _publish_locked(self, stored, removed):
        if not self.kv_muted:
            super()._publish_locked(stored, removed)

    def Stream(self, request, context):
        self.deadlines.append(context.time_remaining())
        yield from super().Stream(request, context)

    def SubscribeKvEvents(self, request, context):
        with self._cond:
            self.subscriptions.append(request.after_sequence_number)
            self._cond.notify_all()
        yield from super().SubscribeKvEvents(request, context)

    def GetModelInfo(self, request, context):
        info = super().GetModelInfo(request, context)
        if self.hash_scheme is not None:
            info.hash_scheme = self.hash_scheme
        return info


@dataclass
class Cluster:
    router: Router
    fakes: list[RecordingFake]
    stub: pb_grpc.GenerationStub
    channel: grpc.aio.Channel

    def address(self, i: int) -> str:
        return f"127.0.0.1:{self.fakes[i].port}"

    def engine(self, i: int) -> EngineClient:
        return self.router.pool._engines[self.address(i)]

    def fake_by_id(self, engine_id: str) -> RecordingFake:
        return next(f for f in self.fakes if f.engine_id == engine_id)

    def index_of(self, engine_id: str) -> int:
        return next(i for i, f in enumerate(self.fakes) if f.engine_id == engine_id)

    def metric(self, name: str, **labels: str) -> float:
        value = self.router.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    async def hold_prefix(self, i: int, prefix: list[int]) -> None:
        """Make fake i cache `prefix` and wait until the router's index knows it (via the
        fake's KV events only)."""
        hashes = hash_prompt_blocks(prefix, BLOCK)
        self.fakes[i].store_blocks(hashes)
        key = self.address(i)
        await until(lambda: self.router.index.match(key, hashes) == len(hashes))

    async def settle(self) -> None:
        """Wait until no engine has anything in flight (as the router sees it)."""
        await until(lambda: all(e.load() == 0 for e in self.router.pool.engines()))


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def start_fakes(behaviors: list[FakeBehavior]) -> list[RecordingFake]:
    fakes = []
    for i, behavior in enumerate(behaviors):
        fake = RecordingFake(f"e{i}", behavior)
        fake.start("127.0.0.1", 0)
        fakes.append(fake)
    return fakes


@contextlib.asynccontextmanager
async def cluster(n: int = 3, behaviors: list[FakeBehavior] | None = None, **router_kw):
    fakes = start_fakes(behaviors or [FakeBehavior() for _ in range(n)])
    kw = dict(engine=[f"127.0.0.1:{f.port}" for f in fakes], port=0, health_interval=0.1,
              load_interval=0.05, seed=0, http_port=None)
    kw.update(router_kw)
    router = Router(RouterConfig(**kw))
    try:
        await router.start()
        assert await wait_ready(router.pool, len(fakes), timeout=10)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            yield Cluster(router, fakes, pb_grpc.GenerationStub(channel), channel)
    finally:
        await router.stop(0)
        for fake in fakes:
            fake.stop(0)


async def stream(stub, request: pb.GenerateRequest, timeout: float = 10) -> list[pb.GenerateChunk]:
    return [chunk async for chunk in stub.Stream(request, timeout=timeout)]


def tokens_of(chunks: list[pb.GenerateChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


# ---- prefix-aware routing ---------------------------------------------------------------


@aio
async def test_kv_events_steer_each_prefix_to_its_engine():
    prefixes = [list(range(10 + 100 * i, 10 + 100 * i + 32)) for i in range(3)]
    async with cluster() as c:
        for i, prefix in enumerate(prefixes):
            await c.hold_prefix(i, prefix)
        for _ in range(2):
            for i, prefix in enumerate(prefixes):
                prompt = prefix + [7, 8]
                chunks = await stream(c.stub, build_request(prompt, max_tokens=3))
                assert {ch.engine_id for ch in chunks} == {f"e{i}"}
                assert tokens_of(chunks) == expected_tokens(prompt, 3)
                assert chunks[-1].usage.cached_prompt_tokens == len(prefix)
                await c.settle()
        assert c.metric("nanoserve_router_requests_total", engine=c.address(0),
                        reason="prefix_hit") == 2
        assert c.metric("nanoserve_router_prefix_matched_tokens_total",
                        engine=c.address(1)) == 2 * 32
        # the hit rate's denominator: matched / prompt tokens = 32 / 34 per engine
        assert c.metric("nanoserve_router_prompt_tokens_total", engine=c.address(1)) == 2 * 34


@aio
async def test_shared_prefix_requests_land_on_one_engine():
    async with cluster() as c:
        first = await stream(c.stub, build_request(HOT + [1], max_tokens=4))
        home = first[0].engine_id
        await c.settle()
        for suffix in range(2, 7):
            chunks = await stream(c.stub, build_request(HOT + [suffix, suffix], max_tokens=4))
            assert {ch.engine_id for ch in chunks} == {home}
            # the engine itself confirms the prefix was in its cache
            assert chunks[-1].usage.cached_prompt_tokens == len(HOT)
            await c.settle()


@aio
async def test_optimistic_insert_keeps_a_prefix_home_before_events_confirm():
    async with cluster(cache_weight=4.0) as c:
        for fake in c.fakes:
            fake.kv_muted = True
        first = await stream(c.stub, build_request(HOT + [1], max_tokens=2))
        home = first[0].engine_id
        # sent at once: the first one's load has not cleared, yet the prefix wins
        results = await asyncio.gather(
            *(stream(c.stub, build_request(HOT + [i], max_tokens=2)) for i in (2, 3)))
        assert {ch.engine_id for chunks in results for ch in chunks} == {home}
        assert all(chunks[-1].usage.cached_prompt_tokens == len(HOT) for chunks in results)
        assert all(index_counts(c.router.index, c.address(i))[0] == 0 for i in range(3))


@aio
async def test_distinct_prefixes_spread():
    behaviors = [FakeBehavior(token_delay_s=0.05) for _ in range(3)]
    # load_interval 5 s: no engine report lands mid-burst, the router's own count decides
    async with cluster(behaviors=behaviors, load_interval=5.0) as c:
        prompts = [list(range(200 + 40 * i, 200 + 40 * i + 40)) for i in range(6)]
        results = await asyncio.gather(
            *(stream(c.stub, build_request(p, max_tokens=6)) for p in prompts))
        for prompt, chunks in zip(prompts, results, strict=True):
            assert tokens_of(chunks) == expected_tokens(prompt, 6)
        per_engine = Counter(chunks[0].engine_id for chunks in results)
        assert set(per_engine) == {"e0", "e1", "e2"}
        assert max(per_engine.values()) <= 3


@pytest.mark.parametrize("guard", [True, False])
@aio
async def test_flood_of_one_prefix_is_spread_by_the_load_guard(guard):
    behaviors = [FakeBehavior(token_delay_s=0.05) for _ in range(3)]
    # A cache weight of 100 makes the 64 cached tokens worth 6400 tokens of load: on cost
    # alone every request stays on the engine holding the prefix.
    async with cluster(behaviors=behaviors, cache_weight=100.0, load_interval=5.0,
                       load_guard_ratio=2.0 if guard else 0.0, load_guard_min=20) as c:
        await c.hold_prefix(0, HOT)
        prompts = [HOT + [i, i] for i in range(9)]
        results = await asyncio.gather(
            *(stream(c.stub, build_request(p, max_tokens=8)) for p in prompts))
        for prompt, chunks in zip(prompts, results, strict=True):
            assert tokens_of(chunks) == expected_tokens(prompt, 8)
        per_engine = Counter(chunks[0].engine_id for chunks in results)
        guarded = sum(c.metric("nanoserve_router_requests_total", engine=c.address(i),
                               reason="load_guard") for i in range(3))
        if guard:
            assert len(per_engine) >= 2
            assert per_engine["e0"] < 9
            assert guarded >= 1
        else:
            assert per_engine == Counter({"e0": 9})
            assert guarded == 0


@aio
async def test_round_robin_and_least_load_policies():
    async with cluster(policy="round-robin") as c:
        seen = []
        for i in range(6):
            chunks = await stream(c.stub, build_request(HOT + [i], max_tokens=2))
            seen.append(chunks[0].engine_id)
        assert Counter(seen) == Counter({"e0": 2, "e1": 2, "e2": 2})
        assert seen[:3] == seen[3:]
    behaviors = [FakeBehavior(token_delay_s=0.05) for _ in range(3)]
    async with cluster(policy="least-load", behaviors=behaviors, load_interval=5.0) as c:
        await c.hold_prefix(0, HOT)
        results = await asyncio.gather(
            *(stream(c.stub, build_request(HOT + [i], max_tokens=6)) for i in range(3)))
        # the prefix is ignored: three equal requests in flight at once go to three engines
        assert {chunks[0].engine_id for chunks in results} == {"e0", "e1", "e2"}


# ---- failures ---------------------------------------------------------------------------


@pytest.mark.parametrize("code,counted", [
    (grpc.StatusCode.UNAVAILABLE, True),
    (grpc.StatusCode.INTERNAL, True),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, False),  # a full queue: retry elsewhere, no penalty
])
@aio
async def test_failure_before_first_token_is_retried_elsewhere(code, counted):
    behaviors = [FakeBehavior(reject_code=code, reject_count=1), FakeBehavior(), FakeBehavior()]
    async with cluster(behaviors=behaviors) as c:
        await c.hold_prefix(0, HOT)  # so e0 is chosen first
        prompt = HOT + [5]
        chunks = await stream(c.stub, build_request(prompt, max_tokens=5))
        assert tokens_of(chunks) == expected_tokens(prompt, 5)
        assert "e0" not in {ch.engine_id for ch in chunks}
        assert len(c.fakes[0].requests) == 1
        assert sum(len(f.requests) for f in c.fakes[1:]) == 1
        assert c.metric("nanoserve_router_retries_total", engine=c.address(0)) == 1
        # e0 chosen for its cache, then the retry's engine counted under reason "retry"
        retried = c.address(1 + [len(f.requests) for f in c.fakes[1:]].index(1))
        assert c.metric("nanoserve_router_requests_total", engine=c.address(0),
                        reason="prefix_hit") == 1
        assert c.metric("nanoserve_router_requests_total", engine=retried, reason="retry") == 1
        assert sum(c.metric("nanoserve_router_requests_total", engine=c.address(i), reason=r)
                   for i in range(3) for r in ("prefix_hit", "prefix_miss", "retry")) == 2
        e0 = c.engine(0)
        assert e0.failures == (1 if counted else 0)
        assert e0.routable() is not counted


@pytest.mark.parametrize("tokens_per_chunk", [1, 2])
@aio
async def test_failure_mid_stream_continues_elsewhere_without_duplicates(tokens_per_chunk):
    behaviors = [FakeBehavior(fail_after_tokens=3, tokens_per_chunk=tokens_per_chunk),
                 FakeBehavior(tokens_per_chunk=tokens_per_chunk),
                 FakeBehavior(tokens_per_chunk=tokens_per_chunk)]
    async with cluster(behaviors=behaviors) as c:
        await c.hold_prefix(0, HOT)
        prompt = HOT + [9]
        request = build_request(prompt, request_id="r-mid", max_tokens=10, min_tokens=5,
                                temperature=0.0, seed=1234)
        chunks = await stream(c.stub, request)
        want = expected_tokens(prompt, 10)
        assert tokens_of(chunks) == want
        assert "".join(ch.text for ch in chunks) == "".join(f" {t}" for t in want)
        assert {ch.request_id for ch in chunks} == {"r-mid"}
        engines = [ch.engine_id for ch in chunks]
        split = sum(len(ch.token_ids) for ch in chunks if ch.engine_id == "e0")
        assert split == 3 and engines[0] == "e0" and engines[-1] != "e0"
        last = chunks[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 10)
        # what the second engine was asked: prompt + the 3 tokens sent, 7 more, same seed
        cont = c.fake_by_id(engines[-1]).requests[-1]
        assert list(cont.token_ids.ids) == prompt + want[:3]
        assert cont.sampling.max_tokens == 7
        assert cont.sampling.min_tokens == 2
        assert cont.sampling.seed == 1234
        assert cont.sampling.HasField("temperature") and cont.sampling.temperature == 0.0
        assert c.metric("nanoserve_router_failovers_total", engine=c.address(0)) == 1
        second = c.address(c.index_of(engines[-1]))
        assert c.metric("nanoserve_router_requests_total", engine=second,
                        reason="continuation") == 1
        assert c.metric("nanoserve_router_retries_total", engine=c.address(0)) == 0


@aio
async def test_two_failovers_in_one_stream_and_unary_generate():
    behaviors = [FakeBehavior(fail_after_tokens=3), FakeBehavior(fail_after_tokens=4),
                 FakeBehavior(fail_after_tokens=4)]
    async with cluster(behaviors=behaviors, failure_backoff=0.05) as c:
        await c.hold_prefix(0, HOT)
        prompt = HOT + [11]
        chunks = await stream(c.stub, build_request(prompt, max_tokens=10))
        assert tokens_of(chunks) == expected_tokens(prompt, 10)  # 3 + 4 + 3
        assert len({ch.engine_id for ch in chunks}) == 3
        await until(lambda: len(c.router.pool.routable()) == 3)
        await c.settle()
        response = await c.stub.Generate(build_request(prompt, max_tokens=10), timeout=10)
        assert list(response.token_ids) == expected_tokens(prompt, 10)
        assert response.text == "".join(f" {t}" for t in expected_tokens(prompt, 10))
        assert response.finish_reason == pb.FINISH_REASON_LENGTH
        assert response.usage.completion_tokens == 10


@aio
async def test_invalid_argument_passes_through_and_does_not_hurt_the_engine():
    async with cluster() as c:
        await c.hold_prefix(1, HOT)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream(c.stub, build_request(HOT + [1], max_tokens=5000))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "max_tokens must be in [1, 1000], got 5000"
        assert [len(f.requests) for f in c.fakes] == [0, 1, 0]  # no retry
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.Generate(build_request(HOT + [1], max_tokens=5000), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        e1 = c.engine(1)
        assert e1.failures == 0 and e1.routable()
        chunks = await stream(c.stub, build_request(HOT + [1], max_tokens=2))
        assert {ch.engine_id for ch in chunks} == {"e1"}


@aio
async def test_router_rejects_a_request_without_prompt():
    async with cluster(n=1) as c:
        for request in (pb.GenerateRequest(), pb.GenerateRequest(messages=pb.ChatMessages())):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stream(c.stub, request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert c.fakes[0].requests == []


@aio
async def test_all_engines_down_is_unavailable_at_once():
    async with cluster() as c:
        for fake in c.fakes:
            fake.stop(0)
        for _ in range(2):  # first: every engine fails; then: none is routable at all
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stream(c.stub, build_request(HOT, max_tokens=4), timeout=1.0)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no healthy engine" in err.value.details()


@aio
async def test_unreachable_engines_unavailable_with_a_clear_message():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    router = Router(RouterConfig(engine=[dead], port=0, health_interval=0.1, http_port=None))
    try:
        await router.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(build_request([1, 2, 3]), timeout=1.0)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert dead in err.value.details() and "health" in err.value.details()
    finally:
        await router.stop(0)


@aio
async def test_passive_failures_back_off_exponentially_and_reset_on_success():
    now = [50.0]
    config = RouterConfig(engine=["127.0.0.1:1"], failure_backoff=1.0, failure_backoff_max=3.0)
    engine = EngineClient("127.0.0.1:1", config, PrefixIndex(), RouterMetrics(),
                          clock=lambda: now[0])
    engine.info = pb.ModelInfo(kv_block_size=4, hash_scheme="xxh3_64-chain-v1")
    engine.serving = True
    assert engine.routable()
    for backoff in (1.0, 2.0, 3.0, 3.0):  # doubling, capped at failure_backoff_max
        engine.record_failure(grpc.StatusCode.UNAVAILABLE)
        assert not engine.routable()
        now[0] += backoff - 0.01
        assert not engine.routable()
        now[0] += 0.01
        assert engine.routable()
    engine.record_success()
    engine.record_failure(grpc.StatusCode.INTERNAL)
    assert engine.down_until == now[0] + 1.0
    await engine.channel.close()


@aio
async def test_load_report_from_before_an_outage_is_dropped():
    """An engine killed with work in flight and restarted must not keep its old load: the
    restarted process has nothing in flight (the real-process failover test saw a restarted
    engine skipped by a burst because of the figure it reported before it died)."""
    fake = start_fakes([FakeBehavior(load=pb.Load(tokens_in_flight=5000, accepting=True))])[0]
    config = RouterConfig(engine=[f"127.0.0.1:{fake.port}"])
    engine = EngineClient(f"127.0.0.1:{fake.port}", config, PrefixIndex(), RouterMetrics())
    try:
        await engine.check_health()
        await engine.poll_load()
        assert engine.serving and engine.load() == 5000
        fake.set_serving(False)
        await engine.check_health()
        assert not engine.serving and engine.load() == 5000  # no poll while not serving
        fake.set_serving(True)
        await engine.check_health()
        assert engine.serving and engine.load() == 0  # before any new load poll
        await engine.poll_load()
        assert engine.load() == 5000  # the next poll brings the engine's own figure back
    finally:
        await engine.channel.close()
        fake.stop(0)


@aio
async def test_unhealthy_or_draining_engine_is_skipped():
    async with cluster() as c:
        await c.hold_prefix(0, HOT)
        c.fakes[0].set_serving(False)
        await until(lambda: not c.engine(0).routable())
        chunks = await stream(c.stub, build_request(HOT + [3], max_tokens=2))
        assert chunks[0].engine_id != "e0"
        c.fakes[0].set_serving(True)
        await until(lambda: c.engine(0).routable())
        c.fakes[0].behavior.accepting = False
        await until(lambda: not c.engine(0).routable())
        assert "draining" in c.engine(0).state()
        await c.settle()
        chunks = await stream(c.stub, build_request(HOT + [4], max_tokens=2))
        assert chunks[0].engine_id != "e0"
        assert not any(r.token_ids.ids[-1] == 4 for r in c.fakes[0].requests)


@aio
async def test_engine_with_another_hash_scheme_is_refused():
    fakes = start_fakes([FakeBehavior(), FakeBehavior()])
    fakes[1].hash_scheme = "sha256-v9"
    router = Router(RouterConfig(engine=[f"127.0.0.1:{f.port}" for f in fakes], port=0,
                                 health_interval=0.1, http_port=None))
    try:
        await router.start()
        assert await wait_ready(router.pool, 1)
        other = router.pool._engines[f"127.0.0.1:{fakes[1].port}"]
        await until(lambda: other.info is not None)
        assert not other.routable() and "hash scheme" in other.state()
        assert len(router.pool.routable()) == 1
    finally:
        await router.stop(0)
        for fake in fakes:
            fake.stop(0)


# ---- cancellation and deadlines ---------------------------------------------------------


@aio
async def test_client_cancel_reaches_the_engine():
    behaviors = [FakeBehavior(token_delay_s=0.05) for _ in range(3)]
    async with cluster(behaviors=behaviors) as c:
        call = c.stub.Stream(build_request(HOT, request_id="r-cancel", max_tokens=500))
        first = await call.read()
        await call.read()
        call.cancel()
        fake = c.fake_by_id(first.engine_id)
        seen = await asyncio.to_thread(fake.wait_until, lambda: "r-cancel" in fake.cancelled, 5)
        assert seen
        assert "r-cancel" not in fake.finished
        assert c.engine(c.index_of(first.engine_id)).failures == 0


@aio
async def test_deadline_reaches_the_engine():
    behaviors = [FakeBehavior(token_delay_s=0.05) for _ in range(3)]
    async with cluster(behaviors=behaviors) as c:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream(c.stub, build_request(HOT, request_id="r-late", max_tokens=500),
                         timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        served = [f for f in c.fakes if f.requests]
        assert len(served) == 1  # a deadline is not a reason to try another engine
        fake = served[0]
        assert fake.deadlines[0] is not None and 0 < fake.deadlines[0] < 1.0  # ~ the 0.5 s
        assert await asyncio.to_thread(fake.wait_until, lambda: "r-late" in fake.cancelled, 5)
        assert all(e.failures == 0 for e in c.router.pool.engines())


# ---- KV event subscriptions -------------------------------------------------------------


@aio
async def test_kv_stream_resumes_after_a_break_and_resnapshots_on_a_gap():
    async with cluster(n=1) as c:
        fake, key, index = c.fakes[0], c.address(0), c.router.index
        first, second, third = (hash_prompt_blocks(list(range(s, s + 16)), BLOCK)
                                for s in (1, 300, 600))
        await c.hold_prefix(0, list(range(1, 17)))
        last = index.resume_point(key)
        assert last == 1  # one batch so far (the fake numbers batches, like engines)
        assert fake.subscriptions == [0]
        # a broken stream resumes after the last sequence number
        fake.break_kv_streams()
        await until(lambda: len(fake.subscriptions) == 2)
        assert fake.subscriptions[-1] == last
        fake.store_blocks(second)
        await until(lambda: index.match(key, second) == len(second))
        fake.remove_blocks(first[-1:])
        await until(lambda: index.match(key, first) == len(first) - 1)
        # lost events (the engine's sequence jumps): the router re-subscribes from 0
        with fake._cond:
            fake._seq += 5
        fake.store_blocks(third)
        await until(lambda: fake.subscriptions[-1] == 0 and len(fake.subscriptions) == 3)
        await until(lambda: index.match(key, third) == len(third))
        assert index.match(key, second) == len(second)
        assert index.match(key, first) == len(first) - 1
        assert index.resume_point(key) == fake._seq


# ---- discovery ------------------------------------------------------------------------


@aio
async def test_dns_discovery_engines_join_and_leave():
    fakes = start_fakes([FakeBehavior(), FakeBehavior()])
    addresses = [f"127.0.0.1:{f.port}" for f in fakes]
    answer = [addresses[0]]
    failing = False

    async def resolver(name: str) -> list[str]:
        assert name == "engines.example:50051"
        if failing:
            raise OSError("resolution failed")
        return list(answer)

    router = Router(RouterConfig(engine_dns="engines.example:50051", dns_interval=0.05,
                                 port=0, health_interval=0.1, http_port=None),
                    resolver=resolver)
    try:
        await router.start()
        assert await wait_ready(router.pool, 1)
        assert [e.key for e in router.pool.engines()] == addresses[:1]
        answer.append(addresses[1])
        await until(lambda: len(router.pool.routable()) == 2)
        failing = True  # a failed resolution keeps what the pool has
        await asyncio.sleep(0.2)
        assert len(router.pool.engines()) == 2
        failing = False
        answer.remove(addresses[0])
        await until(lambda: [e.key for e in router.pool.engines()] == addresses[1:])
        assert not router.index.has_snapshot(addresses[0])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as channel:
            response = await pb_grpc.GenerationStub(channel).Generate(
                build_request([5, 6, 7], max_tokens=2), timeout=5)
        assert response.engine_id == "e1"
    finally:
        await router.stop(0)
        for fake in fakes:
            fake.stop(0)


def test_resolve_dns_gives_host_port_pairs():
    assert "127.0.0.1:4321" in asyncio.run(resolve_dns("localhost:4321"))
    with pytest.raises(ValueError, match="HOST:PORT"):
        asyncio.run(resolve_dns("no-port"))


# ---- tokenizer --------------------------------------------------------------------------

WORDS = ["[UNK]", "hello", "world", "the", "cat", "sat", "user", "assistant", "system", "be",
         "brief"]
SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}")


def write_tokenizer(directory: Path) -> dict[str, int]:
    """A word-level tokenizer; returns its vocab (the test's reference for encoding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}))
    return {**vocab, SPECIALS[0]: len(WORDS), SPECIALS[1]: len(WORDS) + 1}


@pytest.mark.parametrize("from_engine", [True, False])
@aio
async def test_text_and_chat_are_tokenized_once_and_sent_as_ids(tmp_path, from_engine):
    vocab = write_tokenizer(tmp_path / "tok")
    behaviors = [FakeBehavior(tokenizer_dir=str(tmp_path / "tok")) for _ in range(2)]
    extra = {} if from_engine else {"tokenizer": str(tmp_path / "tok")}
    async with cluster(behaviors=behaviors, **extra) as c:
        response = await c.stub.Generate(build_request("hello world the cat", max_tokens=3))
        want_ids = [vocab[w] for w in ("hello", "world", "the", "cat")]
        assert list(response.token_ids) == expected_tokens(want_ids, 3)
        got = [r for f in c.fakes for r in f.requests]
        assert len(got) == 1 and got[0].WhichOneof("prompt") == "token_ids"
        assert list(got[0].token_ids.ids) == want_ids
        messages = [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hello cat"}]
        chunks = await stream(c.stub, build_request(messages, max_tokens=2))
        s, e = vocab["<|im_start|>"], vocab["<|im_end|>"]
        want_chat = [s, vocab["system"], vocab["be"], vocab["brief"], e,
                     s, vocab["user"], vocab["hello"], vocab["cat"], e, s, vocab["assistant"]]
        sent = [list(r.token_ids.ids) for f in c.fakes for r in f.requests]
        assert sorted(sent) == sorted([want_ids, want_chat])
        assert tokens_of(chunks) == expected_tokens(want_chat, 2)


@aio
async def test_text_without_any_tokenizer_is_unavailable_with_reason():
    async with cluster(n=1) as c:  # the fake has no tokenizer to give
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.stub.Generate(build_request("hello"), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "tokenizer" in err.value.details()
        assert c.fakes[0].requests == []


# ---- router health, reflection, metrics --------------------------------------------------


@aio
async def test_router_health_and_metrics_endpoint():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    async with cluster(n=2, metrics_port=metrics_port) as c:
        health = health_pb2_grpc.HealthStub(c.channel)
        for service in ("", "nanoserve.v1.Generation"):
            await until(lambda: c.router.pool.routable() != [])
            reply = None
            for _ in range(100):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    break
                await asyncio.sleep(0.05)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(c.channel)
        replies = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {svc.name async for r in replies for svc in r.list_services_response.service}
        assert {"nanoserve.v1.Generation", "grpc.health.v1.Health"} <= names
        await stream(c.stub, build_request(HOT, max_tokens=2))
        body = await asyncio.to_thread(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                           timeout=5).read().decode())
        assert "nanoserve_router_requests_total{" in body
        assert f'nanoserve_router_engine_healthy{{engine="{c.address(0)}"}} 1.0' in body
        assert "nanoserve_router_prompt_tokens_total" in body


# ---- continuation pieces ----------------------------------------------------------------


def test_continuation_request_carries_prompt_plus_sent_tokens():
    original = build_request("text prompt", request_id="r", max_tokens=10, min_tokens=4,
                             seed=7, temperature=0.0, stop=["x"])
    first = continuation_request(original, "r", [1, 2], [], 10)
    assert list(first.token_ids.ids) == [1, 2]
    assert first.sampling == original.sampling
    cont = continuation_request(original, "r", [1, 2], [3, 4, 5, 6, 7], 10)
    assert list(cont.token_ids.ids) == [1, 2, 3, 4, 5, 6, 7]
    assert (cont.sampling.max_tokens, cont.sampling.min_tokens) == (5, 0)
    assert (cont.sampling.seed, list(cont.sampling.stop)) == (7, ["x"])
    assert original.sampling.max_tokens == 10  # the client's request is not changed
    # unset max_tokens means the default 16; min_tokens stays unset when it was
    default = continuation_request(build_request([9]), "r", [9], [1, 2], 16)
    assert default.sampling.max_tokens == 14
    assert not default.sampling.HasField("min_tokens")


class WordDecoder:
    def decode(self, ids, skip_special_tokens=True):
        words = {1: "héllo", 2: " wörld", 3: "\ufffd"}
        return "".join(words[i] for i in ids)


def test_held_back_text_is_what_the_client_did_not_get():
    tok = WordDecoder()
    assert held_back_text(tok, [1, 2], "héllo", True) == " wörld"
    assert held_back_text(tok, [1, 2], "héllo wörld", True) == ""
    assert held_back_text(tok, [1, 3], "héllo", True) == ""  # an incomplete character
    assert held_back_text(tok, [1, 2], "other", True) == ""  # texts disagree: add nothing
    assert held_back_text(object(), [1], "", True) == ""


# ---- command line ---------------------------------------------------------------------


def parse(argv: list[str]):
    import argparse

    from router.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser, config_from_args(parser.parse_args(argv))


def test_cli_flags_map_to_config():
    _, config = parse([
        "--engine", "a:1", "--engine", "[::1]:2", "--host", "0.0.0.0", "--port", "7",
        "--metrics-port", "9100", "--policy", "least-load", "--tokenizer", "/tok",
        "--cache-weight", "2.5", "--load-guard-ratio", "3", "--load-guard-min", "100",
        "--health-interval", "0.5", "--load-interval", "0.3", "--optimistic-ttl", "4",
        "--max-attempts", "5", "--failure-backoff", "0.25", "--failure-backoff-max", "8",
        "--log-level", "DEBUG"])
    assert config == RouterConfig(
        engine=["a:1", "[::1]:2"], host="0.0.0.0", port=7, metrics_port=9100,
        policy="least-load", tokenizer="/tok", cache_weight=2.5, load_guard_ratio=3.0,
        load_guard_min=100.0, health_interval=0.5, load_interval=0.3, optimistic_ttl=4.0,
        max_attempts=5, failure_backoff=0.25, failure_backoff_max=8.0, log_level="debug")
    _, config = parse(["--engine-dns", "engines.ns.svc:50051", "--dns-interval", "2"])
    assert (config.engine, config.engine_dns, config.dns_interval) == (
        [], "engines.ns.svc:50051", 2.0)
    # defaults are the documented ones
    _, config = parse(["--engine", "a:1"])
    assert (config.port, config.host, config.policy, config.cache_weight, config.metrics_port,
            config.load_guard_ratio, config.load_guard_min) == (
        50050, "127.0.0.1", "prefix", 1.0, None, 2.0, 2048.0)


@pytest.mark.parametrize("argv,message", [
    ([], "--engine"),
    (["--engine", "a:1", "--engine-dns", "b:2"], "not both"),
    (["--engine", "no-port"], "HOST:PORT"),
    (["--engine", "a:1", "--cache-weight", "-1"], "cache_weight"),
    (["--engine", "a:1", "--health-interval", "0"], "health-interval"),
])
def test_cli_rejects_bad_settings(argv, message, capsys):
    from router.cli import main

    parser = parse(["--engine", "a:1"])[0]
    assert main(parser.parse_args(argv)) == 2
    assert message in capsys.readouterr().err
