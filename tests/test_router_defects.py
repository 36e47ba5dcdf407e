"""Regression tests for router defects: unique in-flight request ids, one crash counted
once, prompts too long or too large, bounded error messages, undecodable requests, and
deadline / cancel metrics. Fake engines on loopback (tests/fake_engine.py), as in
tests/test_router.py, whose cluster helpers these tests share."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from google.protobuf.message import DecodeError

from clients.client import build_request
from engine_service.common.sampling_params import quote
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.engine_pool import EngineClient
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex
from router.server import bounded
from tests.fake_engine import FakeBehavior
from tests.procs import ServerProc, start_engine, start_router
from tests.test_router import (
    HOT,
    RecordingFake,
    aio,
    cluster,
    expected_tokens,
    stream,
    tokens_of,
    until,
)

pytestmark = pytest.mark.timeout(120)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
DUPLICATE = "request_id must be unique among requests in flight, got"  # the engines' words


async def rpc_error(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value


def requests_with_id(c, request_id: str) -> int:
    return sum(r.request_id == request_id for f in c.fakes for r in f.requests)


# ---- request ids unique among requests in flight --------------------------------------


@aio
async def test_duplicate_in_flight_request_id_is_refused_even_on_another_engine():
    behaviors = [FakeBehavior(token_delay_s=0.05) for _ in range(3)]
    async with cluster(behaviors=behaviors, policy="round-robin") as c:
        first = c.stub.Stream(build_request(HOT, request_id="dup", max_tokens=500))
        await first.read()
        # round-robin sends the duplicate to another engine, which has not seen the id
        err = await rpc_error(stream(c.stub, build_request(HOT, request_id="dup",
                                                           max_tokens=2)))
        assert err.code() == INVALID
        assert err.details() == f"{DUPLICATE} 'dup'"
        assert requests_with_id(c, "dup") == 1
        first.cancel()
        assert all(e.failures == 0 for e in c.router.pool.engines())


async def end_a_request(c, how: str) -> None:
    """Run one request with id "r" and end it `how`."""
    request = build_request(HOT, request_id="r", max_tokens=500)
    if how == "finished":
        await stream(c.stub, build_request(HOT, request_id="r", max_tokens=3))
    elif how == "cancelled":
        call = c.stub.Stream(request)
        await call.read()
        call.cancel()
    elif how == "deadline":
        await rpc_error(stream(c.stub, request, timeout=0.3))
    elif how == "engine_error":  # the engines' INVALID_ARGUMENT (max_tokens above 1000)
        await rpc_error(stream(c.stub, build_request(HOT, request_id="r", max_tokens=5000)))
    elif how == "router_error":  # the router's own INVALID_ARGUMENT
        await rpc_error(stream(c.stub, build_request(HOT, request_id="r", top_p=2.0)))
    elif how == "failover":  # every engine fails after 2 tokens: 3 attempts, then length
        for fake in c.fakes:
            fake.behavior.fail_after_tokens = 2
        chunks = await stream(c.stub, build_request(HOT, request_id="r", max_tokens=6))
        assert len(tokens_of(chunks)) == 6
        for fake in c.fakes:
            fake.behavior.fail_after_tokens = None
    elif how == "unavailable":
        for fake in c.fakes:
            fake.behavior.reject_code = grpc.StatusCode.UNAVAILABLE
        err = await rpc_error(stream(c.stub, request))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        for fake in c.fakes:
            fake.behavior.reject_code = None


@pytest.mark.parametrize("how", ["finished", "cancelled", "deadline", "engine_error",
                                 "router_error", "failover", "unavailable"])
@aio
async def test_request_id_is_free_again_however_the_request_ended(how):
    behaviors = [FakeBehavior(token_delay_s=0.02) for _ in range(3)]
    async with cluster(behaviors=behaviors, failure_backoff=0.05) as c:
        await end_a_request(c, how)
        await until(lambda: not c.router.servicer.request_ids_in_flight, timeout=3)
        await until(lambda: len(c.router.pool.routable()) == 3)
        chunks = await stream(c.stub, build_request(HOT, request_id="r", max_tokens=2))
        assert tokens_of(chunks) == expected_tokens(HOT, 2)


# ---- one crash counts once; a restarted engine rejoins at once ------------------------


@aio
async def test_failures_of_requests_sent_before_a_counted_failure_count_once():
    now = [100.0]
    config = RouterConfig(engine=["127.0.0.1:1"], failure_backoff=1.0)
    engine = EngineClient("127.0.0.1:1", config, PrefixIndex(), RouterMetrics(),
                          clock=lambda: now[0])
    engine.info = pb.ModelInfo(kv_block_size=4, hash_scheme="xxh3_64-chain-v1")
    engine.serving = True
    handles = [engine.begin_request(10) for _ in range(13)]
    for h in handles:  # one crash fails every stream the engine held
        engine.record_failure(grpc.StatusCode.UNAVAILABLE, h)
        engine.end_request(h)
    assert engine.failures == 1 and engine.down_until == 101.0
    now[0] = 101.0
    assert engine.routable()
    h = engine.begin_request(10)  # sent after that failure: a failure of its own
    engine.record_failure(grpc.StatusCode.UNAVAILABLE, h)
    assert engine.failures == 2 and engine.down_until == 103.0
    await engine.channel.close()


@aio
async def test_crash_with_many_streams_counts_once_and_restarted_engine_rejoins_promptly():
    # A 10 s first backoff: only a health check that sees the engine back can make it
    # routable again within the 3 s asserted below (gRPC's reconnect backoff, capped near
    # 1 s by the router, plus a health check).
    behaviors = [FakeBehavior(token_delay_s=0.05) for _ in range(2)]
    async with cluster(behaviors=behaviors, failure_backoff=10.0) as c:
        e0 = c.engine(0)
        e1 = c.engine(1)
        c.fakes[1].set_serving(False)  # so that every stream starts on e0
        await until(lambda: not e1.routable())
        calls = [c.stub.Stream(build_request(HOT + [i], max_tokens=40), timeout=30)
                 for i in range(13)]
        firsts = [await call.read() for call in calls]
        assert {ch.engine_id for ch in firsts} == {"e0"}
        c.fakes[1].set_serving(True)
        await until(lambda: e1.routable())

        port = c.fakes[0].port
        c.fakes[0].stop(0)  # the crash: all 13 streams fail at once and fail over to e1
        for i, (call, first) in enumerate(zip(calls, firsts, strict=True)):
            chunks = [first]
            while (chunk := await call.read()) is not grpc.aio.EOF:
                chunks.append(chunk)
            assert tokens_of(chunks) == expected_tokens(HOT + [i], 40)
        assert e0.failures == 1
        failures = sum(c.metric("nanoserve_router_engine_failures_total", engine=c.address(0),
                                code=code) for code in ("UNAVAILABLE", "CANCELLED", "INTERNAL"))
        assert failures == 1
        assert c.metric("nanoserve_router_failovers_total", engine=c.address(0)) == 13

        await until(lambda: not e0.serving)  # its health checks fail while it is down
        restarted = RecordingFake("e0", FakeBehavior())
        assert restarted.start("127.0.0.1", port) == port
        c.fakes[0] = restarted
        started = time.monotonic()
        await until(e0.routable, timeout=5)
        assert time.monotonic() - started < 3.0, time.monotonic() - started
        c.fakes[1].set_serving(False)  # so that the next request can only go to e0
        await until(lambda: not e1.routable())
        chunks = await stream(c.stub, build_request([1, 2, 3], max_tokens=2))
        assert {ch.engine_id for ch in chunks} == {"e0"}


# ---- prompts that can never succeed are INVALID_ARGUMENT at the router ----------------


@aio
async def test_prompt_longer_than_every_max_model_len_is_invalid_argument_at_the_router():
    behaviors = [FakeBehavior(max_model_len=64), FakeBehavior(max_model_len=128)]
    async with cluster(behaviors=behaviors) as c:
        err = await rpc_error(stream(c.stub, build_request(list(range(1, 129)),
                                                           max_tokens=1)))
        assert err.code() == INVALID
        assert err.details() == ("prompt must be at most max_model_len - 1 = 127 tokens "
                                 "(room for one output token), got 128")
        assert [len(f.requests) for f in c.fakes] == [0, 0]
        # a prompt only the larger engine can hold goes there, whatever the prefix cache says
        prompt = list(range(1, 101))
        await c.hold_prefix(0, prompt[:64])
        chunks = await stream(c.stub, build_request(prompt, max_tokens=2))
        assert {ch.engine_id for ch in chunks} == {"e1"}
        assert [len(f.requests) for f in c.fakes] == [0, 1]
        assert all(e.failures == 0 for e in c.router.pool.engines())


def write_wide_tokenizer(directory: Path) -> None:
    """Word-level: "w" is id 20000 (3 bytes as a varint), so a long text of "w w w ..."
    becomes a token-id message larger than the text itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "w": 20000}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({}))


@aio
async def test_huge_text_prompt_is_invalid_argument_without_tokenizing(tmp_path):
    write_wide_tokenizer(tmp_path / "tok")
    behaviors = [FakeBehavior(max_model_len=64, vocab_size=30000) for _ in range(2)]
    async with cluster(behaviors=behaviors, tokenizer=str(tmp_path / "tok")) as c:
        tokenizer = c.router.tokenizers.loaded
        encoded = []
        encode = tokenizer.encode
        tokenizer.encode = lambda text, *a, **kw: encoded.append(len(text)) or encode(
            text, *a, **kw)
        huge = "w " * 1_800_000  # 3.6 MB
        for prompt, field, size in ((huge, "text", 3_600_000),  # role + content bytes:
                                    ([{"role": "user", "content": huge}], "messages",
                                     3_600_004)):
            err = await rpc_error(c.stub.Generate(build_request(prompt, max_tokens=1),
                                                  timeout=30))
            assert err.code() == INVALID
            assert err.details() == (f"{field} must be at most 2048 bytes (32 per token of "
                                     f"max_model_len 64), got {size}")
        assert encoded == []
        # under the byte bound it is tokenized, and its token count checked
        err = await rpc_error(c.stub.Generate(build_request("w " * 64, max_tokens=1)))
        assert err.code() == INVALID and "max_model_len - 1 = 63 tokens" in err.details()
        assert encoded == [128]
        response = await c.stub.Generate(build_request("w " * 8, max_tokens=1))
        assert list(response.token_ids) == [20001]
        assert sum(len(f.requests) for f in c.fakes) == 1


@aio
async def test_prompt_over_grpc_default_message_size_gets_the_engines_answer(tmp_path):
    # 4.5 MB of text fits an engine of max_model_len 131072 (32 B a token): the router must
    # parse it and answer as the engine would, not with grpc's RESOURCE_EXHAUSTED.
    write_wide_tokenizer(tmp_path / "tok")
    behaviors = [FakeBehavior(max_model_len=131072, vocab_size=30000)]
    async with cluster(behaviors=behaviors, tokenizer=str(tmp_path / "tok")) as c:
        err = await rpc_error(c.stub.Generate(build_request("w " * 2_250_000, max_tokens=1),
                                              timeout=60))
        assert err.code() == INVALID
        assert err.details().startswith("text must be at most 4194304 bytes")


# ---- error messages never echo a huge value --------------------------------------------


@aio
async def test_duplicate_request_id_message_cuts_a_huge_id():
    behaviors = [FakeBehavior(token_delay_s=0.05) for _ in range(2)]
    async with cluster(behaviors=behaviors) as c:
        long_id = "i" * 100_000
        first = c.stub.Stream(build_request(HOT, request_id=long_id, max_tokens=500))
        await first.read()
        err = await rpc_error(stream(c.stub, build_request(HOT, request_id=long_id)))
        assert err.code() == INVALID
        assert err.details() == f"{DUPLICATE} {quote(long_id)}"
        assert len(err.details()) < 200
        first.cancel()


@aio
async def test_forwarded_engine_messages_are_bounded():
    async with cluster(n=2) as c:
        # an engine's message echoing a huge value, forwarded: capped
        for fake in c.fakes:
            fake._check_locked = lambda request: (INVALID, f"prompt got {'x' * 6000!r}")
        err = await rpc_error(stream(c.stub, build_request(HOT)))
        assert err.code() == INVALID
        assert err.details().startswith("prompt got 'xxx") and len(err.details()) <= 1024
        assert err.details().endswith(f"... (length {len('prompt got ') + 6002})")

        # an engine's long message with nothing quoted: capped as a whole; the UNAVAILABLE
        # message quotes the request id and every engine's message
        for fake in c.fakes:
            fake._check_locked = lambda request: (grpc.StatusCode.UNAVAILABLE, "down " * 1200)
        err = await rpc_error(stream(c.stub, build_request(HOT, request_id="u" * 3000)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert len(err.details().encode()) <= 1024
        assert err.details().startswith(f"no healthy engine could take request {quote('u' * 3000)}")


def test_bounded_caps_long_messages_in_utf8_bytes():
    assert bounded("short 'abc' (request \"r\"); the engine's queue") == (
        "short 'abc' (request \"r\"); the engine's queue")
    huge = f"got {'v' * 4_000_000!r}"
    cut = bounded(huge)
    assert cut.startswith("got 'vvv") and cut.endswith(f"... (length {len(huge)})")
    assert len(cut.encode()) <= 1024
    assert len(bounded("\u00e9" * 5000).encode()) <= 1024  # capped in UTF-8 bytes


# ---- undecodable requests; UNKNOWN from an engine --------------------------------------

# GenerateRequest{request_id: b"\xff\xfe" (not UTF-8), token_ids: {ids: [5]}}
UNDECODABLE = b"\x0a\x02\xff\xfe" + b"\x1a\x03\x0a\x01\x05"
UNDECODABLE_MESSAGE = "request_id must be valid UTF-8; the request could not be decoded"


@aio
async def test_undecodable_request_is_invalid_argument_at_the_router():
    async with cluster(n=2) as c:
        with pytest.raises(DecodeError):  # the bytes really are not a GenerateRequest
            pb.GenerateRequest.FromString(UNDECODABLE)
        for method, kind in (("Generate", c.channel.unary_unary),
                             ("Stream", c.channel.unary_stream)):
            call = kind(f"/nanoserve.v1.Generation/{method}", request_serializer=None,
                        response_deserializer=None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                if method == "Generate":
                    await call(UNDECODABLE, timeout=5)
                else:
                    [m async for m in call(UNDECODABLE, timeout=5)]
            assert err.value.code() == INVALID, method
            assert err.value.details() == UNDECODABLE_MESSAGE
        assert all(f.requests == [] for f in c.fakes)
        chunks = await stream(c.stub, build_request(HOT, max_tokens=2))  # the router is fine
        assert tokens_of(chunks) == expected_tokens(HOT, 2)


@aio
async def test_unknown_from_an_engine_is_not_an_engine_fault():
    behaviors = [FakeBehavior(reject_code=grpc.StatusCode.UNKNOWN) for _ in range(3)]
    async with cluster(behaviors=behaviors) as c:
        err = await rpc_error(stream(c.stub, build_request(HOT, max_tokens=2)))
        assert err.code() == grpc.StatusCode.UNKNOWN
        assert [len(f.requests) for f in c.fakes].count(1) == 1  # not retried
        assert all(e.failures == 0 and e.routable() for e in c.router.pool.engines())


# ---- deadline and cancel metrics -------------------------------------------------------


@aio
async def test_deadline_and_cancel_are_counted_apart():
    behaviors = [FakeBehavior(token_delay_s=0.05) for _ in range(2)]
    async with cluster(behaviors=behaviors) as c:
        def errors(code: str) -> float:
            return c.metric("nanoserve_router_request_errors_total", code=code)

        for _ in range(2):
            err = await rpc_error(stream(c.stub, build_request(HOT, max_tokens=500),
                                         timeout=0.3))
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: errors("DEADLINE_EXCEEDED") == 2)
        call = c.stub.Stream(build_request(HOT, max_tokens=500))
        await call.read()
        call.cancel()
        await until(lambda: errors("CANCELLED") == 1)
        await asyncio.sleep(0.2)
        assert (errors("DEADLINE_EXCEEDED"), errors("CANCELLED")) == (2, 1)


# ---- the same defects through real processes -------------------------------------------
# Two tiny-model CPU engines and a `nanoserve router` on loopback; the kill test restarts
# the engine it kills, so it comes last.

REAL_ENGINE_ARGS = ("--kv-block-size", "4", "--max-model-len", "512", "--num-kv-blocks", "2048")
# default failure backoff (1 s doubling to 30 s): what benched a restarted engine for 30 s
REAL_ROUTER_ARGS = ("--policy", "round-robin", "--health-interval", "0.5")


@pytest.fixture(scope="module")
def real(tiny_model_dir) -> Iterator[tuple[list[ServerProc], ServerProc]]:
    """(engine processes, router process), the router seeing both engines."""
    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(lambda _: start_engine(tiny_model_dir, *REAL_ENGINE_ARGS),
                                range(2)))
    router = start_router([e.target for e in engines], *REAL_ROUTER_ARGS)
    try:
        for e in engines:
            router.wait_for(f"engine {e.target} (", timeout=30)
        yield engines, router
    finally:
        assert router.stop() == 0, router.output()[-3000:]
        for e in engines:
            e.stop()


def real_stream(target: str, request: pb.GenerateRequest,
                timeout: float = 60) -> list[pb.GenerateChunk]:
    with grpc.insecure_channel(target) as channel:
        return list(pb_grpc.GenerationStub(channel).Stream(request, timeout=timeout))


@pytest.mark.timeout(300)
def test_real_bad_requests_are_invalid_argument_at_the_router(real):
    engines, router = real
    cases = [  # (request, start of the message)
        (build_request("w " * 1_800_000, max_tokens=1),  # 3.6 MB of text
         "text must be at most 16384 bytes (32 per token of max_model_len 512)"),
        (build_request(list(range(1, 601)), max_tokens=1),
         "prompt must be at most max_model_len - 1 = 511 tokens"),
        (build_request([1000] * 2_500_000, max_tokens=1),  # 5 MB, past grpc's 4 MiB default
         "prompt must be at most max_model_len - 1 = 511 tokens (room for one output token), "
         "got 2500000"),
        (build_request([1, 2, 3], max_tokens=1, stop=["s" * 100_000]),
         "stop must be strings of 1..256 characters, got 'sss"),
    ]
    for request, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            real_stream(router.target, request)
        assert err.value.code() == INVALID, err.value.details()
        assert err.value.details().startswith(message)
        assert len(err.value.details()) < 300
    with grpc.insecure_channel(router.target) as channel:
        call = channel.unary_unary("/nanoserve.v1.Generation/Generate",
                                   request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            call(UNDECODABLE, timeout=10)
        assert err.value.code() == INVALID
        assert err.value.details() == UNDECODABLE_MESSAGE
    greedy = {"temperature": 0.0, "ignore_eos": True}
    with grpc.insecure_channel(router.target) as channel:  # round-robin: on both engines
        stub = pb_grpc.GenerationStub(channel)
        first = stub.Stream(build_request([5, 6, 7], request_id="same", max_tokens=400,
                                          **greedy), timeout=60)
        first_chunk = next(first)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Stream(build_request([5, 6, 7], request_id="same", max_tokens=2),
                             timeout=60))
        assert err.value.code() == INVALID
        assert err.value.details() == f"{DUPLICATE} 'same'"
        assert len(first_chunk.token_ids) + sum(len(ch.token_ids) for ch in first) == 400
    chunks = real_stream(router.target, build_request([5, 6, 7], request_id="same",
                                                      max_tokens=2, **greedy))
    assert sum(len(ch.token_ids) for ch in chunks) == 2
    assert "failed (" not in router.output()  # no engine was blamed for any of it


@pytest.mark.timeout(300)
def test_real_kill_9_with_many_streams_counts_once_and_restarted_engine_rejoins(
        real, tiny_model_dir):
    engines, router = real
    greedy = {"temperature": 0.0, "ignore_eos": True}
    with grpc.insecure_channel(router.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        calls = [stub.Stream(build_request([10 + i, 11, 12], max_tokens=400, **greedy),
                             timeout=120) for i in range(13)]
        firsts = [next(call) for call in calls]
        victim = engines[0]
        on_victim = sum(ch.engine_id == victim.target for ch in firsts)
        assert on_victim >= 5  # round-robin: about half of them
        os.killpg(victim.proc.pid, signal.SIGKILL)  # frontend and core
        victim.proc.wait(10)
        for call, first in zip(calls, firsts, strict=True):
            assert len(first.token_ids) + sum(len(ch.token_ids) for ch in call) == 400
    failed = re.escape(f"engine {victim.target} failed (")
    assert len(re.findall(failed, router.output())) == 1

    restarted = start_engine(tiny_model_dir, *REAL_ENGINE_ARGS, "--port", str(victim.port))
    engines[0] = restarted
    ready = time.monotonic()  # the engine prints "ready" once it reports SERVING
    while True:
        chunks = real_stream(router.target, build_request([7, 8, 9], max_tokens=1))
        if chunks[0].engine_id == restarted.target:
            break
        assert time.monotonic() - ready < 3.0, "the restarted engine got no traffic"
        time.sleep(0.05)
