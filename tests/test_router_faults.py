"""The router's reliability: streams leave an engine that stops producing tokens (a stall,
or health NOT_SERVING), and admission control (--max-concurrent-requests, a bounded FIFO
queue, --queue-timeout). Fake engines on loopback (tests/fake_engine.py), with the cluster
helpers of tests/test_router.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from clients.client import build_request
from router.admission import Admission
from router.config import RouterConfig
from tests.fake_engine import FakeBehavior
from tests.test_router import HOT, aio, cluster, expected_tokens, parse, stream, tokens_of, until

pytestmark = pytest.mark.timeout(60)

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


async def read_all(call) -> list:
    chunks = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    return chunks


def engine_failures(c, i: int) -> float:
    return sum(c.metric("nanoserve_router_engine_failures_total", engine=c.address(i),
                        code=code.name) for code in grpc.StatusCode)


# ---- streams move off an engine that stops producing tokens ----------------------------


@aio
async def test_streams_of_a_stalled_engine_finish_elsewhere_and_the_stall_counts_once():
    behaviors = [FakeBehavior(stall_after_tokens=3), FakeBehavior()]
    async with cluster(behaviors=behaviors, stream_progress_timeout=0.3) as c:
        await c.hold_prefix(0, HOT)  # every stream starts on e0
        prompts = [HOT + [i] for i in range(3)]
        # the deadline bounds the failover: e0 never sends a 4th token
        results = await asyncio.gather(*(stream(c.stub, build_request(p, max_tokens=10),
                                                timeout=5) for p in prompts))
        for prompt, chunks in zip(prompts, results, strict=True):
            assert tokens_of(chunks) == expected_tokens(prompt, 10)  # as without the stall
            assert [ch.engine_id for ch in chunks[:3]] == ["e0"] * 3
            assert {ch.engine_id for ch in chunks[3:]} == {"e1"}
        e0 = c.engine(0)
        assert e0.failures == 1 and engine_failures(c, 0) == 1
        assert c.metric("nanoserve_router_failovers_total", engine=c.address(0)) == 3
        await until(lambda: len(c.fakes[0].cancelled) == 3)
        await c.settle()  # the abandoned calls no longer count as load anywhere


@aio
async def test_the_wait_for_a_first_chunk_is_not_a_stall():
    # queueing and prefill on a busy engine can take long; only a serving engine's silence
    # after a chunk is a stall
    behaviors = [FakeBehavior(stall_after_tokens=0), FakeBehavior()]
    async with cluster(behaviors=behaviors, stream_progress_timeout=0.2) as c:
        await c.hold_prefix(0, HOT)
        call = c.stub.Stream(build_request(HOT + [5], max_tokens=4), timeout=10)
        await until(lambda: len(c.fakes[0].requests) == 1)
        await asyncio.sleep(0.6)  # three progress timeouts
        c.fakes[0].behavior.stall_after_tokens = None
        chunks = await read_all(call)
        assert tokens_of(chunks) == expected_tokens(HOT + [5], 4)
        assert {ch.engine_id for ch in chunks} == {"e0"}
        assert c.engine(0).failures == 0


@aio
async def test_an_engine_turning_not_serving_has_its_silent_streams_moved():
    # a progress timeout far beyond the deadline: only the health check can move the stream
    behaviors = [FakeBehavior(stall_after_tokens=3), FakeBehavior()]
    async with cluster(behaviors=behaviors, stream_progress_timeout=60) as c:
        await c.hold_prefix(0, HOT)
        prompt = HOT + [7]
        call = c.stub.Stream(build_request(prompt, max_tokens=8), timeout=5)
        first = [await call.read() for _ in range(3)]
        c.fakes[0].set_serving(False)  # as the engine's core watchdog does
        chunks = first + await read_all(call)
        assert tokens_of(chunks) == expected_tokens(prompt, 8)
        assert {ch.engine_id for ch in chunks[3:]} == {"e1"}
        e0 = c.engine(0)
        assert e0.failures == 1
        c.fakes[0].set_serving(True)  # load polls stop while an engine is not serving
        await until(e0.routable)
        await c.settle()


@aio
async def test_a_draining_engine_keeps_the_streams_that_make_progress():
    behaviors = [FakeBehavior(token_delay_s=0.02), FakeBehavior()]
    async with cluster(behaviors=behaviors, health_interval=0.5) as c:
        await c.hold_prefix(0, HOT)
        prompt = HOT + [8]
        call = c.stub.Stream(build_request(prompt, max_tokens=60), timeout=10)
        first = await call.read()
        c.fakes[0].set_serving(False)  # draining: NOT_SERVING, in-flight work finishes
        await until(lambda: not c.engine(0).serving)
        chunks = [first] + await read_all(call)
        assert tokens_of(chunks) == expected_tokens(prompt, 60)
        assert {ch.engine_id for ch in chunks} == {"e0"}
        assert c.engine(0).failures == 0


# ---- admission control ------------------------------------------------------------------


def held_streams(c, first: int, n: int) -> list:
    return [c.stub.Stream(build_request(HOT + [first + i], max_tokens=4), timeout=20)
            for i in range(n)]


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == EXHAUSTED
    assert err.value.trailing_metadata()["retry-after"] == "1"
    assert "retry after ~1 s" in err.value.details()
    return err.value


def prompts_seen(c) -> list[int]:
    return [r.token_ids.ids[-1] for f in c.fakes for r in f.requests]


@aio
async def test_requests_beyond_the_limit_queue_fifo_and_beyond_the_queue_are_refused():
    behaviors = [FakeBehavior(stall_after_tokens=1) for _ in range(2)]  # streams stay open
    async with cluster(behaviors=behaviors, max_concurrent_requests=2, max_queued_requests=2,
                       stream_progress_timeout=60) as c:
        admission = c.router.servicer.admission
        running = held_streams(c, 0, 2)
        firsts = [await call.read() for call in running]
        queued = held_streams(c, 10, 1)  # one at a time, so the queue order is known
        await until(lambda: admission.queued == 1)
        queued += held_streams(c, 11, 1)
        await until(lambda: admission.queued == 2)
        for call in held_streams(c, 20, 2):
            err = await refused(call)
            assert "--max-concurrent-requests=2 with 2 queued" in err.details()
        assert c.metric("nanoserve_router_rejected_requests_total", reason="queue_full") == 2
        assert sorted(prompts_seen(c)) == [0, 1]  # neither queued nor refused ones went out

        running[0].cancel()  # a client that leaves frees its slot: the oldest waiter gets it
        await until(lambda: admission.queued == 1)
        assert sorted(prompts_seen(c)) == [0, 1, 10]
        assert c.metric("nanoserve_router_admission_requests", state="in_flight") == 2

        for fake in c.fakes:
            fake.behavior.stall_after_tokens = None
        assert tokens_of([firsts[1]] + await read_all(running[1])) == expected_tokens(
            HOT + [1], 4)
        for i, call in zip((10, 11), queued, strict=True):
            assert tokens_of(await read_all(call)) == expected_tokens(HOT + [i], 4)
        await until(lambda: admission.in_flight == 0 and admission.queued == 0)


@aio
async def test_queue_timeout_is_resource_exhausted_and_a_waiter_that_leaves_is_dropped():
    behaviors = [FakeBehavior(stall_after_tokens=1) for _ in range(2)]
    async with cluster(behaviors=behaviors, max_concurrent_requests=1, max_queued_requests=4,
                       queue_timeout=0.3, stream_progress_timeout=60) as c:
        admission = c.router.servicer.admission
        [holder] = held_streams(c, 0, 1)
        await holder.read()
        err = await refused(held_streams(c, 1, 1)[0])
        assert "--queue-timeout=0.3 s" in err.details()
        assert c.metric("nanoserve_router_rejected_requests_total", reason="queue_timeout") == 1
        [leaver] = held_streams(c, 2, 1)
        await until(lambda: admission.queued == 1)
        leaver.cancel()
        await until(lambda: admission.queued == 0)
        holder.cancel()
        await until(lambda: admission.in_flight == 0)
        for fake in c.fakes:
            fake.behavior.stall_after_tokens = None
        chunks = await stream(c.stub, build_request(HOT + [3], max_tokens=2))
        assert tokens_of(chunks) == expected_tokens(HOT + [3], 2)
        assert sorted(prompts_seen(c)) == [0, 3]


@aio
async def test_a_slot_granted_to_a_waiter_cancelled_before_it_ran_passes_on():
    admission = Admission(limit=1, max_queued=2, timeout=10)
    release = await admission.acquire()
    second = asyncio.create_task(admission.acquire())
    third = asyncio.create_task(admission.acquire())
    await until(lambda: admission.queued == 2)
    release()
    release()  # idempotent: the done callback and the handler's end both call it
    second.cancel()  # granted the slot, cancelled before it could run
    release_third = await asyncio.wait_for(third, 5)
    assert second.cancelled() and admission.in_flight == 1 and admission.queued == 0
    release_third()
    assert admission.in_flight == 0


# ---- settings ---------------------------------------------------------------------------


def test_reliability_flags_map_to_config():
    _, config = parse(["--engine", "a:1", "--stream-progress-timeout", "2.5",
                       "--max-concurrent-requests", "8", "--max-queued-requests", "0",
                       "--queue-timeout", "4"])
    assert (config.stream_progress_timeout, config.max_concurrent_requests,
            config.max_queued_requests, config.queue_timeout) == (2.5, 8, 0, 4.0)
    _, config = parse(["--engine", "a:1"])  # the documented defaults
    assert (config.stream_progress_timeout, config.max_concurrent_requests,
            config.max_queued_requests, config.queue_timeout) == (10.0, 0, 1024, 30.0)


@pytest.mark.parametrize("field,value,message", [
    ("stream_progress_timeout", 0.0, "stream-progress-timeout must be > 0"),
    ("queue_timeout", -1.0, "queue-timeout must be > 0"),
    ("max_concurrent_requests", -1, "max-concurrent-requests must be >= 0"),
    ("max_queued_requests", -1, "max-queued-requests must be >= 0"),
])
def test_reliability_settings_are_checked(field, value, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(engine=["a:1"], **{field: value})
