"""Priority scheduling (--scheduling-policy priority; lower priority runs earlier): the
scheduler's order and preemption with fake tokens (tests/test_scheduler.py's Harness), the
tiny model through LLMEngine and LLM, a real engine process over gRPC, and the router's
forwarding and admission order (fake engines, tests/test_router.py)."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import grpc
import pytest

from clients import Client
from clients.client import build_request
from engine_service import LLM, SamplingParams
from engine_service.sequence import Sequence
from router.server import continuation_request
from tests.fake_engine import FakeBehavior
from tests.helpers import greedy, random_prompts, spy_preemptions, spy_schedule
from tests.procs import start_engine, wait_blocks_free
from tests.test_router import HOT, aio, cluster, until
from tests.test_scheduler import Harness, expected_output, prompt

pytestmark = pytest.mark.timeout(120)


def harness(make_config, overlap: bool = False, **kw) -> Harness:
    kw.setdefault("kv_block_size", 4)
    return Harness(make_config(**kw), overlap=overlap)


def add(h: Harness, seq_id: str, tokens: list[int], priority: int, max_tokens: int) -> Sequence:
    seq = Sequence(seq_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   priority=priority)
    h.sched.add(seq)
    return seq


def finish(h: Harness) -> list[str]:
    """Run to the end; the ids in finish order, after checking every output and block."""
    h.run()
    for s in h.finished:
        assert s.output_token_ids == expected_output(s, s.sampling_params.max_tokens)
    assert h.bm.all_free(), "blocks still referenced after the run"
    return [s.seq_id for s in h.finished]


# ---- the scheduler alone --------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_waiting_queue_and_admission_follow_priority_then_arrival(make_config, overlap):
    rng = random.Random(0)
    prios = [rng.randint(-3, 3) for _ in range(30)]  # ties on purpose
    by_key = [f"r{i}" for _, i in sorted((p, i) for i, p in enumerate(prios))]
    for policy, want in (("priority", by_key), ("fcfs", [f"r{i}" for i in range(30)])):
        h = harness(make_config, overlap, scheduling_policy=policy, max_num_seqs=1)
        for i, p in enumerate(prios):
            add(h, f"r{i}", prompt(3 + i % 5, 10 * i), p, 2)
        assert [s.seq_id for s in h.sched.waiting] == want
        assert finish(h) == want  # one at a time: admission order is finish order


def trace(make_config, policy: str, prios: list[int], overlap: bool) -> list:
    """Every step's rows and preemptions, and the finish order, of a workload that runs
    out of KV blocks, with arrivals spread over the run."""
    h = harness(make_config, overlap, scheduling_policy=policy, max_num_batched_tokens=24,
                max_num_seqs=5, num_kv_blocks=14, max_model_len=48)
    steps: list = []
    h.on_schedule = lambda out: steps.append(
        ([(r.seq.seq_id, r.start, r.num_new_tokens) for r in out.scheduled],
         [s.seq_id for s in out.preempted]))
    lens = random_prompts(len(prios), seed=3, lo=4, hi=20)
    for i, p in enumerate(prios):
        add(h, f"r{i}", prompt(len(lens[i]), 50 * i), p, 12)
        h.step()
    order = finish(h)
    assert any(pre for _, pre in steps), "the workload was meant to preempt"
    return [steps, order]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_equal_priorities_are_fcfs_and_fcfs_ignores_priority(make_config, overlap):
    n = 10
    mixed = [5, 0, 9, 0, 3, 9, 1, 2, 0, 4]
    fcfs = trace(make_config, "fcfs", [0] * n, overlap)
    assert trace(make_config, "priority", [7] * n, overlap) == fcfs
    assert trace(make_config, "fcfs", mixed, overlap) == fcfs
    assert trace(make_config, "priority", mixed, overlap) != fcfs  # the policy does act


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_urgent_arrival_preempts_the_worst_running_when_blocks_run_out(make_config, overlap):
    # 12 blocks of 4: three 12-token prompts decode into their 4th block and fill them all.
    h = harness(make_config, overlap, scheduling_policy="priority", num_kv_blocks=12,
                max_model_len=48)
    for i in range(3):
        add(h, f"low{i}", prompt(12, 100 * (i + 1)), 5, 20)
    for _ in range(3):
        h.step()
    assert h.bm.num_free_blocks == 0 and h.sched.num_running == 3
    urgent = add(h, "urgent", prompt(8, 900), 0, 4)
    out, _ = h.step()
    # the newest of the equal-priority ones goes first, and only as many as needed
    assert [s.seq_id for s in out.preempted] == ["low2"]
    assert "urgent" in [r.seq.seq_id for r in out.scheduled]
    order = finish(h)
    assert order[0] == "urgent" and urgent.num_preemptions == 0
    assert h.finished[-1].seq_id == "low2"


def test_urgent_arrival_preempts_for_a_max_num_seqs_slot(make_config):
    h = harness(make_config, scheduling_policy="priority", max_num_seqs=2)
    add(h, "a", prompt(6), 4, 8)
    add(h, "b", prompt(6, 200), 2, 8)  # more urgent than a, though it came later
    h.step()
    add(h, "c", prompt(6, 300), 3, 8)  # beats a: a is preempted for its slot
    out, _ = h.step()
    assert [s.seq_id for s in out.preempted] == ["a"]
    assert [r.seq.seq_id for r in out.scheduled] == ["b", "c"]
    add(h, "d", prompt(6, 400), 9, 8)  # worse than every running one: waits
    out, _ = h.step()
    assert not out.preempted and [s.seq_id for s in h.sched.waiting] == ["a", "d"]
    assert finish(h)[-2:] == ["a", "d"]


# ---- the tiny model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    # 24 blocks of 4: three 60-token sequences cannot all stay.
    return LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_block_size=4,
               num_kv_blocks=24, max_model_len=96, scheduling_policy="priority")


def test_urgent_request_preempts_low_priority_ones_and_finishes_first(llm):
    engine = llm.engine
    low, (urgent,) = random_prompts(3, seed=11, lo=20, hi=24), random_prompts(1, seed=12,
                                                                                lo=20, hi=20)
    preempted = spy_preemptions(llm)
    steps = spy_schedule(llm, lambda out: [[r.seq.seq_id for r in out.scheduled]])
    for i, p in enumerate(low):
        engine.add_request(f"low{i}", p, greedy(30), priority=5)
    tokens: dict[str, list[int]] = {}
    finished: list[str] = []

    def step() -> None:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.append(out.request_id)

    for _ in range(4):
        step()
    assert not preempted and not finished
    engine.add_request("urgent", urgent, greedy(10), priority=0)
    while engine.has_unfinished():
        step()
    assert finished[0] == "urgent" and "urgent" in steps[4]  # admitted as it arrived
    assert preempted[0] == "low2"  # the worst key: priority 5, the newest
    assert "urgent" not in preempted and set(preempted) <= {"low0", "low1", "low2"}
    assert tokens["urgent"] == llm.generate([urgent], greedy(10), use_tqdm=False)[0].token_ids
    alone = llm.generate(low, greedy(30), use_tqdm=False)
    assert [tokens[f"low{i}"] for i in range(3)] == [o.token_ids for o in alone]


def test_generate_takes_one_priority_per_prompt(llm, make_config):
    prompts = random_prompts(3, seed=13, lo=3, hi=8)
    plain = llm.generate(prompts, greedy(4), use_tqdm=False)
    ranked = llm.generate(prompts, greedy(4), use_tqdm=False, priority=[3, -1, 2])
    assert [o.token_ids for o in ranked] == [o.token_ids for o in plain]  # prompt order
    for bad in ([1], [1, 2, 3, 4], [1, None, 2]):
        with pytest.raises(ValueError, match=r"priority must be one int per prompt \(3\)"):
            llm.generate(prompts, greedy(4), use_tqdm=False, priority=bad)
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \('fcfs', "
                                         r"'priority'\), got 'lifo'"):
        make_config(scheduling_policy="lifo")


# ---- a real engine over gRPC ------------------------------------------------------------


def test_engine_serves_queued_requests_by_priority(tiny_model_dir):
    engine = start_engine(tiny_model_dir, "--scheduling-policy", "priority",
                          "--max-num-seqs", "1", "--kv-block-size", "4",
                          "--max-model-len", "512")
    try:
        with Client(engine.target, timeout=60) as client:
            blocker = client.stream([5, 6, 7], max_tokens=500, ignore_eos=True)
            next(blocker)  # it runs: the others queue behind it (max_num_seqs=1)
            finished: list[int] = []
            lock = threading.Lock()

            def run(priority: int) -> None:
                client.generate([9, priority], max_tokens=8, ignore_eos=True,
                                priority=priority)
                with lock:
                    finished.append(priority)

            threads = [threading.Thread(target=run, args=(p,)) for p in (3, 1, 2)]
            for t in threads:
                t.start()
            while client.load().num_waiting < 3:
                assert all(t.is_alive() for t in threads), "a request ran past the blocker"
                time.sleep(0.01)
            blocker.close()  # its slot goes to the most urgent waiter
            for t in threads:
                t.join(60)
            assert finished == [1, 2, 3]
            assert wait_blocks_free(client).kv_blocks_used == 0
    finally:
        assert engine.stop() == 0, engine.output()[-3000:]


# ---- the router -------------------------------------------------------------------------


@aio
async def test_router_forwards_priority_and_admits_waiters_by_it():
    behaviors = [FakeBehavior(stall_after_tokens=1)]  # streams stay open until released
    async with cluster(behaviors=behaviors, max_concurrent_requests=1,
                       stream_progress_timeout=60) as c:
        admission, fake = c.router.servicer.admission, c.fakes[0]
        holder = c.stub.Stream(build_request(HOT + [0], max_tokens=2, priority=7), timeout=20)
        await holder.read()
        assert fake.requests[0].priority == 7  # forwarded unchanged
        queued = []
        for i, prio in enumerate((3, 1, 2, 1)):  # one at a time, so arrivals are known
            queued.append(c.stub.Stream(build_request(HOT + [i + 1], max_tokens=2,
                                                      priority=prio), timeout=20))
            await until(lambda n=i + 1: admission.queued == n)
        fake.behavior.stall_after_tokens = None
        holder.cancel()
        await asyncio.gather(*(_drain(call) for call in queued))
        sent = [(r.token_ids.ids[-1], r.priority) for r in fake.requests[1:]]
        assert sent == [(2, 1), (4, 1), (3, 2), (1, 3)]  # priority, then arrival
        await until(lambda: admission.in_flight == 0)
    # a stream continued on another engine keeps its priority
    assert continuation_request(build_request([1], priority=4), "r", [1], [2], 5).priority == 4


async def _drain(call) -> None:
    while await call.read() is not grpc.aio.EOF:
        pass
