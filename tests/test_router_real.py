"""The router over real processes: three tiny-model CPU engines (`nanoserve engine`) and
the router itself (`nanoserve router`), all on loopback ports.

What the fakes in test_router.py cannot show: real KV events and real cached-token counts,
real load figures, a real `kill -9` in the middle of a greedy stream, an engine restarted
on its port, and a restarted router rebuilding its prefix index from the engines'
snapshots. Engine ids are the engines' HOST:PORT (= their targets), so a chunk's
engine_id names the process that served it.

The tests share three module-scoped engines and run in file order: the kill test restarts
the engine it kills; the all-engines-down test kills every engine and so comes last.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from clients import Client
from clients.client import Chunk, build_request
from clients.errors import Unavailable
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from tests.procs import ServerProc, start_engine, start_router, wait_blocks_free

pytestmark = pytest.mark.timeout(300)

BLOCK = 4
ENGINE_ARGS = ("--kv-block-size", str(BLOCK), "--max-model-len", "512",
               "--num-kv-blocks", "512")
# Quick health and load polls so failures and load show up within a few hundred ms;
# debug logs every routing decision with its reason (asserted on below).
ROUTER_ARGS = ("--health-interval", "0.2", "--load-interval", "0.1", "--log-level", "debug")
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(n)]


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class Engines:
    """The module's engine processes; the kill test swaps a dead one for a restarted one."""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        with ThreadPoolExecutor(3) as pool:  # start together: each spends seconds importing
            self.procs = list(pool.map(lambda _: start_engine(model_dir, *ENGINE_ARGS),
                                       range(3)))

    @property
    def targets(self) -> list[str]:
        return [p.target for p in self.procs]

    def live(self) -> list[ServerProc]:
        return [p for p in self.procs if p.proc.poll() is None]

    def by_target(self, target: str) -> ServerProc:
        return next(p for p in self.procs if p.target == target)

    def kill(self, target: str) -> None:
        """kill -9 the whole engine: frontend and core (its own process group)."""
        proc = self.by_target(target)
        os.killpg(proc.proc.pid, signal.SIGKILL)
        proc.proc.wait(10)

    def restart(self, target: str) -> ServerProc:
        dead = self.by_target(target)
        assert dead.proc.poll() is not None
        new = start_engine(self.model_dir, *ENGINE_ARGS, "--port", str(dead.port))
        assert new.target == target
        self.procs[self.procs.index(dead)] = new
        return new

    def assert_all_blocks_free(self, timeout: float = 10.0) -> None:
        """Every live engine ends idle with no KV block held (GetLoad, polled)."""
        for proc in self.live():
            with Client(proc.target, timeout=2.0) as c:
                load = wait_blocks_free(c, timeout)
                assert load.kv_blocks_used == load.num_running == load.num_waiting == 0, (
                    f"{proc.target} still holds KV blocks or requests: {load}")


@pytest.fixture(scope="module")
def engines(tiny_model_dir) -> Iterator[Engines]:
    cluster = Engines(tiny_model_dir)
    yield cluster
    for proc in cluster.live():
        assert proc.stop() == 0, proc.output()[-3000:]


def log_count(router: ServerProc, pattern: str) -> int:
    return len(re.findall(pattern, router.output()))


def wait_router_sees(router: ServerProc, targets: list[str], snapshots: int = 1) -> None:
    """Wait until the router has read every engine's KV snapshot `snapshots` times (it
    reads one when it first reaches an engine, and again after the engine restarted)."""
    for t in targets:
        wait_for(lambda t=t: log_count(router, re.escape(f"engine {t}: KV snapshot"))
                 >= snapshots, f"the router's KV snapshot #{snapshots} of {t}")


@pytest.fixture
def make_router(engines: Engines) -> Iterator[Callable[..., ServerProc]]:
    """`make_router(*flags)`: a router over the engines, started and holding every
    engine's KV snapshot; stopped (exit code 0) after the test."""
    routers: list[ServerProc] = []

    def make(*extra: str) -> ServerProc:
        router = start_router(engines.targets, *ROUTER_ARGS, *extra)
        routers.append(router)
        wait_router_sees(router, engines.targets)
        return router

    yield make
    for router in routers:
        assert router.stop() == 0, router.output()[-3000:]


def stream(target: str, prompt: list[int], **sampling) -> list[Chunk]:
    with Client(target, timeout=60.0) as c:
        return list(c.stream(prompt, **sampling))


def tokens_of(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def simultaneous_streams(target: str, prompts: list[list[int]],
                         **sampling) -> list[list[Chunk]]:
    """Start one Stream per prompt at once (a raw call starts when created, so they reach
    the router together whatever the threads or the machine do), then read them all."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        calls = [stub.Stream(build_request(p, **sampling), timeout=60.0) for p in prompts]
        return [[Chunk.from_proto(m) for m in call] for call in calls]


def test_prefix_lands_on_its_engine_and_distinct_prefixes_spread(engines, make_router):
    router = make_router()
    prefixes = [random_ids(24 * BLOCK, seed=100 + i) for i in range(3)]
    # Three distinct prompts at once, none cached anywhere: the router counts each request
    # it sent (prompt + max_tokens) on its engine until that engine's own load report
    # holds it, so the second and third see the first engine(s) busy and go elsewhere.
    first = simultaneous_streams(router.target, [p + [7] for p in prefixes],
                                 max_tokens=24, **GREEDY)
    homes = [chunks[0].engine_id for chunks in first]
    assert sorted(homes) == sorted(engines.targets), homes
    for chunks in first:
        assert {c.engine_id for c in chunks} == {chunks[0].engine_id}
        assert len(tokens_of(chunks)) == 24
    engines.assert_all_blocks_free()
    # Same prefix, new suffix: back to the engine that cached it, which reports the
    # whole prefix (24 full blocks) as served from its cache.
    for round_ in range(2):
        for prefix, home in zip(prefixes, homes, strict=True):
            chunks = stream(router.target, prefix + [20 + round_, 30 + round_], max_tokens=4,
                            **GREEDY)
            assert {c.engine_id for c in chunks} == {home}
            assert chunks[-1].usage.cached_prompt_tokens == len(prefix)
            assert chunks[-1].usage.prompt_tokens == len(prefix) + 2
    assert log_count(router, rf"reason=prefix_hit prompt_tokens=98 matched_tokens={24 * BLOCK}"
                     ) == 6
    engines.assert_all_blocks_free()


def test_flood_on_one_system_prompt_is_spread_by_the_load_guard(engines, make_router):
    # --cache-weight 100: the 128 cached tokens are worth 12800 tokens of load, more than
    # the whole flood puts on the prefix's engine (9 x (2 + 24) = 234), so cost alone
    # would keep every request there. --load-guard-min 8 (ratio 2): one flood request in
    # flight on the home engine (2 uncached prompt tokens + 24 to generate = 26 > 8) while
    # another engine is idle (2 x 0 = 0) already fires the guard. The router counts every
    # request it has sent until the engine's own report holds it, so the guard does not
    # depend on when load reports land. The router's routing log shows that the guard is
    # what first sent the prefix to each other engine.
    router = make_router("--cache-weight", "100", "--load-guard-ratio", "2",
                         "--load-guard-min", "8")
    system = random_ids(32 * BLOCK, seed=200)
    home = stream(router.target, system + [1], max_tokens=2, **GREEDY)[0].engine_id
    engines.assert_all_blocks_free()
    flood = simultaneous_streams(router.target, [system + [i, i] for i in range(2, 11)],
                                 max_tokens=24, **GREEDY)
    served = Counter(chunks[0].engine_id for chunks in flood)
    assert len(served) >= 2, served
    assert served[home] >= 1
    for chunks in flood:
        assert len(tokens_of(chunks)) == 24 and chunks[-1].finish_reason == "length"
        if chunks[0].engine_id == home:
            assert chunks[-1].usage.cached_prompt_tokens == len(system)
    # Each other engine got its first flood request from the guard (after that, the
    # prefix counts as cached there too and cost alone may send it more).
    decisions = re.findall(r"route request=\S+ engine=(\S+) reason=(\w+)", router.output())
    assert len(decisions) == 1 + len(flood)
    first_reason = {}
    for engine, reason in decisions[1:]:
        first_reason.setdefault(engine, reason)
    assert first_reason.pop(home) == "prefix_hit"
    assert set(first_reason.values()) == {"load_guard"}, decisions
    engines.assert_all_blocks_free()


def test_kill_9_mid_stream_continues_exactly_then_engine_rejoins(engines, make_router):
    # A short failure backoff: the restarted engine is routable as soon as its health
    # check passes (the dead one is kept out by failing health checks anyway).
    router = make_router("--failure-backoff", "0.2")
    prompt = random_ids(40, seed=300)
    sampling = {"max_tokens": 200, **GREEDY}
    reference = tokens_of(stream(router.target, prompt, **sampling))  # uninterrupted
    assert len(reference) == 200
    engines.assert_all_blocks_free()

    with Client(router.target, timeout=60.0) as c:
        it = c.stream(prompt, **sampling)
        chunks = [next(it)]
        victim = chunks[0].engine_id  # the prompt's home (cached by the reference run)
        engines.kill(victim)
        chunks.extend(it)
    assert tokens_of(chunks) == reference
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 200
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    by_victim = sum(len(ch.token_ids) for ch in chunks if ch.engine_id == victim)
    assert 0 < by_victim < 200 and chunks[-1].engine_id != victim  # killed mid-stream
    failed = re.escape(f"engine {victim} failed (")
    assert log_count(router, failed) == 1

    # Later requests, even one for the prefix the dead engine held, go elsewhere.
    for p in (prompt, random_ids(40, seed=301), random_ids(40, seed=302)):
        later = stream(router.target, p, max_tokens=4, **GREEDY)
        assert victim not in {ch.engine_id for ch in later}
        assert len(tokens_of(later)) == 4
    assert log_count(router, failed) == 1  # none of them was even tried on it
    engines.assert_all_blocks_free()

    # Restarted on its port, the engine rejoins (health, then a fresh KV snapshot) and
    # takes its share of a burst of three distinct prompts again.
    engines.restart(victim)
    wait_router_sees(router, [victim], snapshots=2)
    burst = simultaneous_streams(router.target,
                                 [random_ids(64, seed=310 + i) for i in range(3)],
                                 max_tokens=24, **GREEDY)
    assert sorted(chunks[0].engine_id for chunks in burst) == sorted(engines.targets)
    engines.assert_all_blocks_free()


def test_router_restart_rebuilds_prefix_index_from_snapshots(engines, make_router):
    prefix = random_ids(24 * BLOCK, seed=400)
    first = make_router()
    home = stream(first.target, prefix + [1, 2], max_tokens=4, **GREEDY)[0].engine_id
    assert first.stop() == 0
    # A new router process knows nothing but what the engines' KV snapshots tell it.
    second = make_router()
    chunks = stream(second.target, prefix + [3, 4], max_tokens=4, **GREEDY)
    assert {c.engine_id for c in chunks} == {home}
    assert chunks[-1].usage.cached_prompt_tokens == len(prefix)
    # ... and it routed there because it knew, not by a lucky tie among idle engines.
    assert log_count(second, rf"engine={re.escape(home)} reason=prefix_hit prompt_tokens=98 "
                             rf"matched_tokens={len(prefix)}") == 1
    engines.assert_all_blocks_free()


def test_all_engines_down_is_unavailable_within_a_second(engines, make_router):
    router = make_router()
    prompt = random_ids(16, seed=500)
    assert len(tokens_of(stream(router.target, prompt, max_tokens=2, **GREEDY))) == 2
    engines.assert_all_blocks_free()
    for target in engines.targets:
        engines.kill(target)
    with Client(router.target) as c:
        # First before the router's health checks noticed (every engine is tried and
        # refuses the connection), then once it reports itself NOT_SERVING (none is
        # routable). A 1 s deadline: anything slower is DEADLINE_EXCEEDED, not UNAVAILABLE.
        for phase in ("tried", "noticed"):
            if phase == "noticed":
                wait_for(lambda: c.health() == "NOT_SERVING", "the router to notice")
            with pytest.raises(Unavailable, match="no healthy engine"):
                c.generate(prompt, max_tokens=2, timeout=1.0)
    assert not engines.live()
