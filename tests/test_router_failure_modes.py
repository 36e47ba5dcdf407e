"""Regression tests for the known failure modes of cache-aware routers.

Each mode, and where a router that has it fails a test:
  1. gRPC mode with no load accounting sends everything to the first worker:
     test_a_burst_of_misses_is_spread_by_the_routers_own_count (here, fakes over gRPC: an
     exact 3/3/3 split, where tests/test_router.py::test_distinct_prefixes_spread accepts
     splits that random ties give too).
  2. A cache miss picks an engine by its cache alone (the smallest tree) even when that
     engine is overloaded, a "death spiral":
     test_a_miss_never_lands_on_an_overloaded_engine and
     test_misses_stay_balanced_with_the_guard_on (here, policy unit tests);
     tests/test_router_policy.py::test_prefix_cost_trades_cache_against_load covers a hit
     on a loaded engine against a miss on an idle one.
  3. At low concurrency a miss always lands on the same engine:
     test_misses_one_at_a_time_spread_over_the_engines (here, fakes over gRPC: the router's
     own tie-break RNG); tests/test_router_policy.py::test_prefix_full_tie_is_random covers
     the policy's tie-break.
  4. The load guard (the router's own in-flight count per engine) is released before the
     stream ends: test_the_routers_count_holds_until_the_stream_ends (here, fakes).
  5. A client disconnect is not propagated as an abort to the engine:
     tests/test_router.py::test_client_cancel_reaches_the_engine (gRPC Stream) and
     ::test_deadline_reaches_the_engine; test_a_cancelled_unary_generate_aborts_on_the_engine
     (here, gRPC Generate); tests/test_openai_api.py::
     test_cancelled_stream_and_dropped_request_abort_and_free_their_blocks (HTTP front of a
     real router).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import grpc
import pytest

from clients.client import build_request
from router.policy import REASON_PREFIX_MISS, Candidate, PolicyConfig, choose
from tests.fake_engine import FakeBehavior
from tests.test_router import aio, cluster, expected_tokens, stream, tokens_of, until

# No engine load report lands during these tests: the router's own count alone decides.
NO_REPORTS_S = 30.0


def distinct_prompts(n: int, length: int = 40) -> list[list[int]]:
    """Prompts that share no block with each other (every one a cache miss)."""
    return [list(range(200 + length * i, 200 + length * (i + 1))) for i in range(n)]


# ---- 1. no load accounting in gRPC mode -------------------------------------------------


@pytest.mark.parametrize("policy", ["prefix", "least-load"])
@aio
async def test_a_burst_of_misses_is_spread_by_the_routers_own_count(policy):
    behaviors = [FakeBehavior(token_delay_s=0.05) for _ in range(3)]
    async with cluster(behaviors=behaviors, policy=policy, load_interval=NO_REPORTS_S) as c:
        prompts = distinct_prompts(9)
        results = await asyncio.gather(
            *(stream(c.stub, build_request(p, max_tokens=6)) for p in prompts))
        for prompt, chunks in zip(prompts, results, strict=True):
            assert tokens_of(chunks) == expected_tokens(prompt, 6)
        # equal requests, all routed before any ends: each one counts until it ends, so
        # the engines take turns
        per_engine = Counter(chunks[0].engine_id for chunks in results)
        assert per_engine == Counter({"e0": 3, "e1": 3, "e2": 3})


# ---- 2. a miss sent by cache alone to an overloaded engine ------------------------------


@pytest.mark.parametrize("guard_ratio", [0.0, 2.0])
def test_a_miss_never_lands_on_an_overloaded_engine(guard_ratio):
    config = PolicyConfig(policy="prefix", load_guard_ratio=guard_ratio)
    # a is overloaded and holds nothing (the smallest tree); b and c are busy but not full
    miss = [Candidate("a", load=50_000, cached_tokens=0),
            Candidate("b", load=300, cached_tokens=0), Candidate("c", load=200, cached_tokens=0)]
    # a's few cached tokens are no reason to pile more onto it
    small_hit = [Candidate("a", load=50_000, cached_tokens=16), *miss[1:]]
    for seed in range(30):
        d = choose(miss, 1000, config, random.Random(seed), seed)
        assert (d.key, d.reason) == ("c", REASON_PREFIX_MISS)
        assert choose(small_hit, 1000, config, random.Random(seed), seed).key == "c"


def test_misses_stay_balanced_with_the_guard_on():
    """Misses one after another, each adding its tokens to the chosen engine's load (none
    ends): with the router's defaults the engines take turns. A cost by cache alone, with
    the load guard as the only brake, lets one engine run a guard's gap ahead first."""
    config = PolicyConfig(policy="prefix")  # the router's defaults
    rng = random.Random(0)
    loads = {"a": 0.0, "b": 0.0, "c": 0.0}
    prompt_tokens, max_tokens = 500, 100
    for i in range(60):
        candidates = [Candidate(k, load=v, cached_tokens=0) for k, v in loads.items()]
        d = choose(candidates, prompt_tokens, config, rng, i)
        loads[d.key] += prompt_tokens + max_tokens
        assert max(loads.values()) - min(loads.values()) <= prompt_tokens + max_tokens


# ---- 3. low concurrency: every miss on one engine ---------------------------------------


@aio
async def test_misses_one_at_a_time_spread_over_the_engines():
    async with cluster() as c:
        seen = []
        for prompt in distinct_prompts(12):
            await c.settle()  # every engine idle: each miss is a full tie
            chunks = await stream(c.stub, build_request(prompt, max_tokens=2))
            assert tokens_of(chunks) == expected_tokens(prompt, 2)
            seen.append(chunks[0].engine_id)
        assert set(seen) == {"e0", "e1", "e2"}


# ---- 4. the router's in-flight count released before the stream ends ---------------------


@aio
async def test_the_routers_count_holds_until_the_stream_ends():
    # every stream pauses after 3 tokens (the others ask for 2) until the test lets it go on
    behaviors = [FakeBehavior(stall_after_tokens=3) for _ in range(3)]
    async with cluster(behaviors=behaviors, load_interval=NO_REPORTS_S) as c:
        first, *others_prompts = distinct_prompts(6)
        call = c.stub.Stream(build_request(first, max_tokens=20))
        chunks = [await call.read() for _ in range(3)]
        busy = c.engine(c.index_of(chunks[0].engine_id))
        # prompt + max_tokens, counted from the send to the last chunk
        assert busy.load() == len(first) + 20
        others = [e for e in c.router.pool.engines() if e is not busy]
        assert all(e.load() == 0 for e in others)
        # a miss meanwhile goes to an idle engine, not to the one still streaming
        for prompt in others_prompts:
            other = await stream(c.stub, build_request(prompt, max_tokens=2))
            assert other[0].engine_id != chunks[0].engine_id
            assert busy.load() == len(first) + 20
        c.fake_by_id(chunks[0].engine_id).behavior.stall_after_tokens = None
        while (chunk := await call.read()) is not grpc.aio.EOF:
            chunks.append(chunk)
        assert len(tokens_of(chunks)) == 20 and chunks[-1].finish_reason
        await until(lambda: busy.load() == 0, timeout=2)  # released once it ended


# ---- 5. a client that leaves: the engine must abort ------------------------------------


@aio
async def test_a_cancelled_unary_generate_aborts_on_the_engine():
    behaviors = [FakeBehavior(token_delay_s=0.05) for _ in range(3)]
    async with cluster(behaviors=behaviors) as c:
        call = c.stub.Generate(build_request(distinct_prompts(1)[0], request_id="r-gen",
                                             max_tokens=500))
        await until(lambda: any(f.requests for f in c.fakes))
        fake = next(f for f in c.fakes if f.requests)
        await asyncio.sleep(0.2)  # a few tokens into the generation
        call.cancel()
        assert await asyncio.to_thread(fake.wait_until, lambda: "r-gen" in fake.cancelled, 5)
        assert "r-gen" not in fake.finished
        assert all(e.failures == 0 for e in c.router.pool.engines())
        await c.settle()
