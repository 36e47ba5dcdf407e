"""Tensor parallelism on CPU (gloo): the control channel's delta encoding, TP=2 greedy tokens
identical to TP=1, the engine service at TP=2, and no rank left behind when things die."""

from __future__ import annotations

import itertools
import os
import random
import signal
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from clients import Client
from engine_service import LLM, SamplingParams
from engine_service.block_manager import BlockManager
from engine_service.scheduler import ScheduledSeq, Scheduler
from engine_service.sequence import Sequence
from engine_service.tp_worker import ROW_HEADER, StepEncoder, decode_step, finish_step
from models.layers.sampler import SAMPLING_EPS
from tests.helpers import greedy as ignore_eos_greedy
from tests.helpers import random_prompts, shared_prefix_prompts, spy_preemptions
from tests.procs import start_engine, wait_blocks_free

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 12
GONE_WITHIN_S = 20.0  # a hang guard: "no process left" must hold well before this


# ---------------------------------------------------------------- /proc helpers


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, None when it does not exist."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                children.setdefault(st[1], []).append(int(name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")  # a zombie has exited


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def tp_workers_of(root: int) -> list[int]:
    return [p for p in descendants(root) if "engine_service.tp_worker" in cmdline(p)]


def wait_all_gone(pids: list[int], timeout: float = GONE_WITHIN_S) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if running(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


# ---------------------------------------------------------------- delta encoding


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _check_mirror(batch, mirrored) -> None:
    assert len(mirrored) == len(batch)
    for item, got in zip(batch, mirrored, strict=True):
        seq, m = item.seq, got.seq
        assert m.token_ids == seq.token_ids, seq.seq_id
        assert m.block_table == seq.block_table, seq.seq_id
        assert m.num_computed_tokens == got.start == item.start, seq.seq_id
        assert (got.num_new_tokens, got.sample) == (item.num_new_tokens, item.sample)
        # What a worker's own draw needs: the same seed, output index and float32
        # temperature as rank 0's sampler (which treats T < SAMPLING_EPS as greedy).
        assert (m.seed, got.output_index) == (seq.seed, item.output_index), seq.seq_id
        temperature = seq.sampling_params.temperature
        assert m.sampling_params.temperature == _float32(
            0.0 if temperature < SAMPLING_EPS else temperature), seq.seq_id


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])
def test_worker_mirror_follows_the_scheduler(make_config, overlap):
    """Drive the real scheduler through prefix hits, chunked prefill, preemption, aborts and
    a reused request id; after every step the worker's rebuilt batch must equal rank 0's.
    With `overlap` each step is scheduled (and sent) before the previous step's tokens are
    postprocessed, as async scheduling does: the mirror then lags by the pending token."""
    rng = random.Random(0)
    config = make_config(kv_block_size=4, num_kv_blocks=40, max_num_batched_tokens=24,
                         max_model_len=128)
    bm = BlockManager(config.num_kv_blocks, config.kv_block_size)
    sched = Scheduler(config, bm, eos_token_ids=[])
    shared = [rng.randrange(300) for _ in range(12)]

    def add(rid: str) -> Sequence:
        prompt = (shared if rng.random() < 0.5 else []) + [
            rng.randrange(300) for _ in range(rng.randint(1, 30))]
        sp = SamplingParams(max_tokens=rng.randint(3, 20), ignore_eos=True,
                            temperature=rng.choice([0.0, 1e-7, 0.7, 1.3]),
                            seed=rng.choice([None, 0, 2**31 - 1, 2**31, 2**63 - 1]))
        seq = Sequence(rid, prompt, sp)
        sched.add(seq)
        return seq

    def finish(out) -> None:
        sched.postprocess(out, [rng.randrange(300) if s.sample else None
                                for s in out.scheduled])

    for i in range(10):
        add(f"r{i}")
    encoder, mirror, ids = StepEncoder(), [], itertools.count()
    seen = dict(preempted=0, hits=0, reused=0, steps=0, lagging=0)
    next_id = 10
    in_flight = None
    while sched.has_unfinished() or in_flight is not None:
        out = sched.schedule()
        seen["preempted"] += len(out.preempted)
        if not out.is_empty:
            sharded = rng.random() < 0.5
            batch, got_sharded = decode_step(encoder.encode(out.scheduled, sharded), mirror,
                                             ids)
            _check_mirror(out.scheduled, batch)
            assert got_sharded == sharded
            seen["hits"] += sum(1 for s in out.scheduled if s.seq.num_cached_tokens > 0)
            seen["lagging"] += sum(1 for s in batch
                                   if len(s.seq.token_ids) < s.start + s.num_new_tokens)
            mirror = finish_step(batch)
        if in_flight is not None:
            finish(in_flight)
            in_flight = None
        if out.is_empty:
            continue
        if overlap:
            in_flight = out
        else:
            finish(out)
        seen["steps"] += 1
        if seen["steps"] % 7 == 0 and sched.running:  # abort one, reuse its id at once
            victim = rng.choice(sched.running).seq_id
            sched.abort(victim)
            add(victim)
            seen["reused"] += 1
        if next_id < 30 and seen["steps"] % 3 == 0:
            add(f"r{next_id}")
            next_id += 1
    assert seen["preempted"] and seen["hits"] and seen["reused"], seen
    assert bool(seen["lagging"]) == overlap, seen  # overlapped rows wait for a device token
    assert bm.num_free_blocks == bm.num_blocks


def _first_step(seq: Sequence, num_new: int) -> tuple[StepEncoder, list]:
    encoder = StepEncoder()
    step = [ScheduledSeq(seq, num_new, seq.num_computed_tokens + num_new == seq.num_tokens,
                         seq.num_computed_tokens)]
    mirror = finish_step(decode_step(encoder.encode(step), [], itertools.count())[0])
    seq.num_computed_tokens += num_new
    return encoder, mirror


def _next_step_mirrors(encoder: StepEncoder, mirror: list, seq: Sequence) -> None:
    step = [ScheduledSeq(seq, seq.num_tokens - seq.num_computed_tokens, True,
                         seq.num_computed_tokens)]
    _check_mirror(step, decode_step(encoder.encode(step), mirror, itertools.count(100))[0])


@pytest.mark.parametrize("case", ["other_blocks", "fewer_computed", "reused_id"])
def test_changed_sequences_are_resent_in_full(case):
    """Cases a scheduler run rarely reaches, each caught by one check only: a sequence
    preempted while no step ran and readmitted (on other blocks with the same computed count,
    or on the same blocks with fewer tokens computed), and a request id reused by a new
    request that hits the old one's blocks mid-prompt."""
    sp = SamplingParams(max_tokens=8)
    if case == "reused_id":
        a = Sequence("a", list(range(1, 17)), sp)
        a.block_table = [0, 1]
        encoder, mirror = _first_step(a, 8)  # a chunk: the worker holds all 16 tokens
        b = Sequence("a", list(range(1, 9)) + [99] * 8, sp)
        b.block_table, b.num_computed_tokens = [0, 1, 3, 4], 8
        _next_step_mirrors(encoder, mirror, b)
        return
    a = Sequence("a", list(range(1, 13)), sp)
    a.block_table = [0, 1, 2]
    encoder, mirror = _first_step(a, 12)
    a.token_ids.append(13)
    if case == "other_blocks":
        a.block_table = [5, 6, 7, 8]
    else:
        a.block_table, a.num_computed_tokens = [0, 1, 2, 8], 8
    _next_step_mirrors(encoder, mirror, a)


def test_decode_message_is_small_and_independent_of_context_length(make_config):
    sizes = {}
    for prompt_len in (8, 200):
        config = make_config(kv_block_size=16, num_kv_blocks=512, max_model_len=256)
        sched = Scheduler(config, BlockManager(512, 16), eos_token_ids=[])
        for i in range(32):
            sched.add(Sequence(f"s{i}", [i % 300] * prompt_len,
                               SamplingParams(max_tokens=20, ignore_eos=True)))
        encoder, mirror, msgs, ids = StepEncoder(), [], [], itertools.count()
        for _ in range(6):
            out = sched.schedule()
            msg = encoder.encode(out.scheduled)
            msgs.append((msg, [s.num_new_tokens for s in out.scheduled]))
            mirror = finish_step(decode_step(msg, mirror, ids)[0])
            sched.postprocess(out, [7 if s.sample else None for s in out.scheduled])
        decode = [m for m, lens in msgs if lens == [1] * 32]
        assert len(decode) >= 4
        sizes[prompt_len] = min(len(m) for m in decode)
        # A decode row: header + its one new token (+ a block id when it crosses a block).
        assert all(len(m) <= 4 + 32 * (ROW_HEADER + 2) * 4 for m in decode)
        assert len(msgs[0][0]) > 32 * prompt_len * 4  # the first step carried the prompts
    assert sizes[8] == sizes[200], sizes


# ---------------------------------------------------------------- offline LLM, TP=2 vs TP=1


def greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return ignore_eos_greedy(n)


def make_llm(model_dir, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", num_kv_blocks=256, kv_block_size=4,
                max_model_len=256)
    args.update(kw)
    return LLM(str(model_dir), **args)


def generate_tp1_then_tp2(model_dir, prompt_sets, spy_preemption: bool = False,
                          params=None, on_tp2=None, **kw):
    """Token ids per prompt set at TP=1, then at TP=2 (greedy unless `params` gives one
    SamplingParams list per set; `on_tp2(llm)` runs before the TP=2 engine generates). The
    TP=1 engine is done before the TP=2 one starts: the process group is process-wide, and
    a TP=1 model run inside it would join its collectives."""
    params = params or [greedy()] * len(prompt_sets)
    tp1 = make_llm(model_dir, **kw)
    ref = [tp1.generate(ps, sp, use_tqdm=False)
           for ps, sp in zip(prompt_sets, params, strict=True)]
    tp2 = make_llm(model_dir, tensor_parallel_size=2, **kw)
    preempted = spy_preemptions(tp2) if spy_preemption else []
    if on_tp2 is not None:
        on_tp2(tp2)
    try:
        assert tp2.engine.model_runner.model.attention_layers()[0].num_kv_heads == 1
        got = [tp2.generate(ps, sp, use_tqdm=False)
               for ps, sp in zip(prompt_sets, params, strict=True)]
    finally:
        tp2.engine.shutdown()
    return ref, got, preempted


@pytest.mark.slow
def test_tp2_greedy_equals_tp1_with_prefix_hits_and_chunks(tiny_model_dir):
    prompts = shared_prefix_prompts(seed=1) + [
        random_prompts(1, 500, seed=n, lo=n, hi=n)[0] for n in (1, 7, 33, 70)]
    # A budget of 32 tokens chunks the long prompts and mixes chunks with decode rows.
    ref, got, _ = generate_tp1_then_tp2(tiny_model_dir, [prompts, prompts],
                                        max_num_batched_tokens=32)
    for r_pass, g_pass in zip(ref, got, strict=True):
        assert [o.token_ids for o in g_pass] == [o.token_ids for o in r_pass]
        assert all(o.finish_reason == "length" for o in g_pass)
    assert all(o.num_cached_tokens >= 40 for o in got[1][:4]), "second pass missed the cache"


@pytest.mark.slow
def test_tp2_greedy_equals_tp1_under_preemption(tiny_model_dir):
    rng = random.Random(7)
    prompts = [[rng.randrange(500) for _ in range(rng.randint(20, 40))] for _ in range(8)]
    # 24 blocks of 4 tokens: two sequences of ~52 tokens do not fit together.
    ref, got, preempted = generate_tp1_then_tp2(
        tiny_model_dir, [prompts], spy_preemption=True, num_kv_blocks=24, max_model_len=96)
    assert [o.token_ids for o in got[0]] == [o.token_ids for o in ref[0]]
    assert preempted, "the KV budget was meant to force preemption"


@pytest.mark.slow
def test_tp2_seeded_sampling_equals_tp1_sharded_and_gathered(tiny_model_dir):
    """Seeded temperature draws at TP=2 give TP=1's tokens both ways a step can sample:
    the first pass is temperature-only, so every rank draws over its own vocab shard; in
    the second one row also asks for logprobs, so the logits are gathered and rank 0
    samples and broadcasts. The workers follow rank 0's choice (else a collective would
    not line up)."""
    prompts = random_prompts(6, 500, seed=3, lo=5, hi=30)
    temps = [0.8, 0.0, 1.3, 0.8, 1e-7, 0.5]
    sampled = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=t,
                              seed=1000 + i) for i, t in enumerate(temps)]
    with_logprobs = list(sampled)
    with_logprobs[3] = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8,
                                      seed=1003, logprobs=2)
    calls = {"sharded": 0, "gathered": 0}

    def spy(llm) -> None:
        sampler = llm.engine.model_runner.sampler
        shard, full = sampler.sample_shard, sampler.forward

        def sample_shard(*a, **k):
            calls["sharded"] += 1
            return shard(*a, **k)

        def forward(*a, **k):
            calls["gathered"] += 1
            return full(*a, **k)

        sampler.sample_shard, sampler.forward = sample_shard, forward

    ref, got, _ = generate_tp1_then_tp2(tiny_model_dir, [prompts, prompts],
                                        params=[sampled, with_logprobs], on_tp2=spy)
    for r_pass, g_pass in zip(ref, got, strict=True):
        assert [o.token_ids for o in g_pass] == [o.token_ids for o in r_pass]
    assert calls["sharded"] >= MAX_TOKENS and calls["gathered"] >= MAX_TOKENS, calls


@pytest.mark.slow
def test_tp2_constrained_requests_equal_tp1(tiny_model_dir):
    """Structured output, logit_bias and allowed_token_ids at TP=2: rank 0 masks the gathered
    logits and the workers take its tokens; every row matches TP=1 and the grammars end."""
    schema = ('{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, '
              '"maximum": 9}}, "required": ["n"]}')
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, json_schema=schema)
              for i in range(3)]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=7, regex="[a-c]{2,4}x"),
               SamplingParams(max_tokens=6, logit_bias={40: 100.0}),
               SamplingParams(max_tokens=6, temperature=1.0, seed=3, allowed_token_ids=[5, 9])]
    prompts = random_prompts(len(params), 500, seed=4, lo=3, hi=12)
    ref, got, _ = generate_tp1_then_tp2(tiny_model_dir, [prompts], params=[params])
    assert [o.token_ids for o in got[0]] == [o.token_ids for o in ref[0]]
    assert [o.finish_reason for o in got[0][:4]] == ["stop"] * 4
    assert set(got[0][4].token_ids) == {40} and set(got[0][5].token_ids) <= {5, 9}


@pytest.mark.slow
def test_bad_tp_size_is_a_clear_error_and_leaves_no_rank(tiny_model_dir):
    import torch.distributed as dist

    with pytest.raises(ValueError, match="divisible by the tensor-parallel size"):
        make_llm(tiny_model_dir, tensor_parallel_size=3)  # 4 heads do not split 3 ways
    assert not dist.is_initialized()
    assert wait_all_gone(tp_workers_of(os.getpid())) == []
    ok = make_llm(tiny_model_dir)  # the process can host an engine again
    assert len(ok.generate([[1, 2, 3]], greedy(2), use_tqdm=False)[0].token_ids) == 2


@pytest.mark.slow
def test_offline_dead_rank_is_a_clear_error_and_cleans_up(tiny_model_dir):
    import torch.distributed as dist

    tp2 = make_llm(tiny_model_dir, tensor_parallel_size=2)
    try:
        (worker,) = tp_workers_of(os.getpid())
        os.kill(worker, signal.SIGKILL)
        assert wait_all_gone([worker]) == []
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 .*died"):
            tp2.generate([[1, 2, 3]], greedy(4), use_tqdm=False)
    finally:
        tp2.engine.shutdown()
    assert not dist.is_initialized()
    ok = make_llm(tiny_model_dir)  # the process can host an engine again
    assert len(ok.generate([[1, 2, 3]], greedy(2), use_tqdm=False)[0].token_ids) == 2


@pytest.mark.slow
def test_a_failed_step_stops_the_engine_and_its_ranks(tiny_model_dir, monkeypatch):
    """Rank 0 failing before its collectives leaves the workers waiting in one: later steps
    must refuse clearly (not misalign the ranks), and shutdown must not wait on them."""
    tp2 = make_llm(tiny_model_dir, tensor_parallel_size=2)
    runner = tp2.engine.model_runner
    try:
        (worker,) = tp_workers_of(os.getpid())

        def broken_prepare(batch):
            raise ValueError("injected")

        monkeypatch.setattr(runner, "prepare_inputs", broken_prepare)
        with pytest.raises(ValueError, match="injected"):
            tp2.generate([[1, 2, 3]], greedy(4), use_tqdm=False)
        monkeypatch.undo()
        with pytest.raises(RuntimeError, match="step failed earlier.*injected"):
            tp2.generate([[1, 2, 3]], greedy(4), use_tqdm=False)
    finally:
        tp2.engine.shutdown()
    assert wait_all_gone([worker]) == []


# ---------------------------------------------------------------- engine service at TP=2


def start_tp_engine(model_dir):
    return start_engine(model_dir, "--tensor-parallel-size", "2", "--kv-block-size", "4",
                        "--max-model-len", "512")


@pytest.mark.slow
def test_service_tp2_concurrent_streams_and_clean_stop(tiny_model_dir):
    ps = random_prompts(16, seed=2)
    offline = make_llm(tiny_model_dir, num_kv_blocks=512, max_model_len=512)
    expected = [o.token_ids for o in offline.generate(ps, greedy(8), use_tqdm=False)]
    engine = start_tp_engine(tiny_model_dir)
    try:
        workers = tp_workers_of(engine.proc.pid)
        assert len(workers) == 1, descendants(engine.proc.pid)
        with Client(engine.target) as client:
            assert client.model_info().tensor_parallel_size == 2

            def run(p):
                return [t for c in client.stream(p, temperature=0, max_tokens=8,
                                                 ignore_eos=True) for t in c.token_ids]

            with ThreadPoolExecutor(16) as pool:
                got = list(pool.map(run, ps))
            assert got == expected
            load = wait_blocks_free(client)
            assert load.kv_blocks_used == 0 and load.num_running == 0
        tree = descendants(engine.proc.pid)
    finally:
        code = engine.stop()
    assert code == 0, engine.output()[-3000:]
    assert wait_all_gone(tree) == []


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["engine", "core"])
def test_sigkill_leaves_no_rank(tiny_model_dir, victim):
    """SIGKILL of the engine's main process (the core sees its pipe close and stops the
    ranks), or of the core itself (rank 0: the workers notice their parent is gone)."""
    engine = start_tp_engine(tiny_model_dir)
    try:
        tree = descendants(engine.proc.pid)
        (worker,) = tp_workers_of(engine.proc.pid)
        core = _stat(worker)[1]
        assert core in tree and core != engine.proc.pid
        os.kill(engine.proc.pid if victim == "engine" else core, signal.SIGKILL)
        code = engine.proc.wait(GONE_WITHIN_S)
        left = wait_all_gone(tree)
        if victim == "core":
            assert code == 1, engine.output()[-3000:]
    finally:
        for pid in descendants(engine.proc.pid):
            os.kill(pid, signal.SIGKILL)
    assert left == [], [cmdline(p) for p in left]


@pytest.mark.slow
@pytest.mark.parametrize("when", ["idle", "streaming"])
def test_dead_rank_fails_the_engine_instead_of_hanging(tiny_model_dir, when):
    engine = start_tp_engine(tiny_model_dir)
    try:
        tree = descendants(engine.proc.pid)
        (worker,) = tp_workers_of(engine.proc.pid)
        stream_error: list[BaseException] = []
        first_chunk = threading.Event()

        def stream() -> None:
            try:
                with Client(engine.target) as client:
                    for _ in client.stream([1, 2, 3], temperature=0, max_tokens=500,
                                           ignore_eos=True):
                        first_chunk.set()
            except Exception as exc:  # noqa: BLE001 (any failure is what we wait for)
                stream_error.append(exc)
            first_chunk.set()

        streamer = threading.Thread(target=stream, daemon=True)
        if when == "streaming":
            streamer.start()
            assert first_chunk.wait(60)
        os.kill(worker, signal.SIGKILL)
        code = engine.proc.wait(GONE_WITHIN_S)
        if when == "streaming":
            streamer.join(GONE_WITHIN_S)
            assert stream_error, "the stream ended normally though a rank died mid-way"
        left = wait_all_gone(tree)
    finally:
        engine.stop(signal.SIGKILL)
    out = engine.output()
    assert code == 1, out[-3000:]
    assert "tensor-parallel rank 1" in out and "died" in out, out[-3000:]
    assert left == [], [cmdline(p) for p in left]
