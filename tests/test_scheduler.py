"""Scheduler driven with fake sampled tokens (no model): budget, chunking, preemption, stops.

A fake KV cache records which token each slot holds, so every step also checks that the
context a scheduled row relies on (its first num_computed_tokens) really is its own tokens,
whether it came from its own prefill, a prefix-cache hit, or a recompute after preemption.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine_service.block_manager import BlockManager
from engine_service.common.sampling_params import SamplingParams
from engine_service.config import EngineConfig
from engine_service.scheduler import Scheduler, SchedulerOutput
from engine_service.sequence import Sequence, SequenceStatus
from models.attention_metadata import BlockTableCache, make_attention_metadata
from tests.helpers import check_block_manager

EOS = 2
BS = 4


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[..., EngineConfig]:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"max_position_embeddings": 256}))

    def make(**kw: object) -> EngineConfig:
        kw.setdefault("kv_block_size", BS)
        kw.setdefault("num_kv_blocks", 64)
        return EngineConfig(model=str(model_dir), **kw)

    return make


def next_token(seq: Sequence, index: int) -> int:
    """Output `index` of seq: deterministic in (request, position), like greedy decoding, so
    recompute cannot change it. Never EOS (2) or the stop ids the tests use (>= 1000)."""
    position = seq.num_prompt_tokens + index
    return 10 + (sum(map(ord, seq.seq_id)) * 7 + position * 13) % 900


TokenFn = Callable[[Sequence, int], int]


class Harness:
    """Drives the scheduler like the engine does. With `overlap` (async scheduling) a step's
    sampled tokens reach postprocess only after the next step is scheduled; until then the
    "device" holds them, and the next step's KV writes read them from there."""

    def __init__(self, config: EngineConfig, eos: tuple[int, ...] = (EOS,),
                 overlap: bool = False) -> None:
        self.config = config
        self.bm = BlockManager(config.num_kv_blocks, config.kv_block_size)
        self.sched = Scheduler(config, self.bm, list(eos))
        self.kv: dict[tuple[int, int], int] = {}  # (block, offset) -> token held there
        self.finished: list[Sequence] = []
        self.overlap = overlap
        self._in_flight: tuple[SchedulerOutput, list[int | None]] | None = None
        self._device: dict[str, int] = {}  # the in-flight step's sampled tokens
        self._n = 0
        # Sees each batch as the model runner would: after schedule, before postprocess.
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None

    def add(self, prompt: list[int], seq_id: str | None = None, **params: object) -> Sequence:
        self._n += 1
        seq = Sequence(seq_id or f"r{self._n}", prompt, SamplingParams(**params))
        self.sched.add(seq)
        return seq

    def step(self, tokens: TokenFn = next_token) -> tuple[SchedulerOutput, list[Sequence]]:
        out = self.sched.schedule()
        self.check_batch(out)
        if self.on_schedule is not None:
            self.on_schedule(out)
        self.write_kv(out)
        sampled = [tokens(r.seq, r.output_index) if r.sample else None for r in out.scheduled]
        if not self.overlap:
            done = self.sched.postprocess(out, sampled)
        else:
            done = self.sched.postprocess(*self._in_flight) if self._in_flight else []
            self._in_flight = (out, sampled) if not out.is_empty else None
            self._device = {r.seq.seq_id: t for r, t in zip(out.scheduled, sampled, strict=True)
                            if t is not None}
        self.finished += done
        check_block_manager(self.bm)
        return out, done

    def write_kv(self, out: SchedulerOutput) -> None:
        """What the model does: store each scheduled chunk's KV in its slots (a pending
        input token comes from the device)."""
        for r in out.scheduled:
            s = r.seq
            for pos in range(r.start, r.start + r.num_new_tokens):
                block = s.block_table[pos // BS]
                assert self.bm.blocks[block].ref_count == 1, "writing into a shared block"
                token = s.token_ids[pos] if pos < s.num_tokens else self._device[s.seq_id]
                self.kv[(block, pos % BS)] = token

    def check_batch(self, out: SchedulerOutput) -> None:
        cfg = self.config
        assert out.num_batched_tokens == sum(r.num_new_tokens for r in out.scheduled)
        assert out.num_prefill_tokens == sum(r.num_new_tokens for r in out.scheduled
                                             if not r.is_decode)
        assert out.num_batched_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert self.sched.num_running <= cfg.max_num_seqs
        assert len({r.seq.seq_id for r in out.scheduled}) == len(out.scheduled)
        for r in out.scheduled:
            s = r.seq
            assert r.num_new_tokens >= 1
            assert s.status is SequenceStatus.RUNNING
            end = r.start + r.num_new_tokens
            assert s.num_computed_tokens == end  # the step is committed as launched
            before = s.num_tokens + s.num_pending_tokens - r.sample  # incl. a pending input
            assert end <= before and r.sample == (end == before)
            assert s.num_pending_tokens <= 1 + r.sample
            assert len(s.block_table) * BS >= end
            for pos in range(r.start):  # the context it attends to is its own
                assert self.kv.get((s.block_table[pos // BS], pos % BS)) == s.token_ids[pos]
        for s in out.preempted:
            assert s.status is SequenceStatus.WAITING and s.block_table == []

    def run(self, max_steps: int = 1000, **kw: object) -> list[Sequence]:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return self.finished
            out, done = self.step(**kw)
            assert not out.is_empty or out.preempted or done, "no progress"
        raise AssertionError("did not finish")


@pytest.fixture
def harnesses() -> Iterator[list[Harness]]:
    made: list[Harness] = []
    yield made
    for h in made:  # after every test every block is free again
        check_block_manager(h.bm)
        assert h.bm.all_free(), "blocks still referenced at the end of the test"


@pytest.fixture
def harness(make_config, harnesses) -> Callable[..., Harness]:
    """Step-by-step expectations: the synchronous loop only."""
    def make(eos: tuple[int, ...] = (EOS,), **kw: object) -> Harness:
        h = Harness(make_config(**kw), eos)
        harnesses.append(h)
        return h

    return make


@pytest.fixture(params=[False, True], ids=["sync", "overlap"])
def any_harness(request, make_config, harnesses) -> Callable[..., Harness]:
    """Outcome-only expectations: both the synchronous and the overlapped loop."""
    def make(eos: tuple[int, ...] = (EOS,), **kw: object) -> Harness:
        h = Harness(make_config(**kw), eos, overlap=request.param)
        harnesses.append(h)
        return h

    return make


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def expected_output(seq: Sequence, n: int) -> list[int]:
    """Plain replay of next_token for n tokens from seq's prompt."""
    return [next_token(seq, i) for i in range(n)]


# -- budget, order, chunking -----------------------------------------------------------------

def test_budget_and_seq_cap_respected(any_harness) -> None:
    h = any_harness(max_num_batched_tokens=16, max_num_seqs=3)
    seqs = [h.add(prompt(7, 100 + 10 * i), max_tokens=5, ignore_eos=True) for i in range(10)]
    saw_full_budget = False
    while h.sched.has_unfinished():
        out, _ = h.step()
        assert len(out.scheduled) <= 3
        saw_full_budget |= out.num_batched_tokens == 16
    assert saw_full_budget  # the budget is actually used, not just respected
    for s in seqs:
        assert s.finish_reason == "length" and s.output_token_ids == expected_output(s, 5)


def test_decode_rows_first_then_prefill_chunks(harness) -> None:
    h = harness(max_num_batched_tokens=8)
    a = h.add(prompt(5), max_tokens=10)
    out, _ = h.step()
    assert [(r.seq, r.num_new_tokens, r.sample) for r in out.scheduled] == [(a, 5, True)]
    b = h.add(prompt(20, 300), max_tokens=3)
    c = h.add(prompt(3, 500), max_tokens=3)
    out, _ = h.step()
    assert [(r.seq, r.num_new_tokens, r.sample) for r in out.scheduled] == \
        [(a, 1, True), (b, 7, False)]  # c waits: b is ahead of it and took the budget
    assert h.sched.num_waiting == 1
    out, _ = h.step()
    # a decodes first, then b continues its prefill, then c would come; budget is 8
    assert [(r.seq, r.num_new_tokens) for r in out.scheduled] == [(a, 1), (b, 7)]
    out, _ = h.step()
    assert [(r.seq, r.num_new_tokens, r.sample) for r in out.scheduled] == \
        [(a, 1, True), (b, 6, True), (c, 1, False)]
    out, _ = h.step()
    assert [(r.seq, r.num_new_tokens, r.sample) for r in out.scheduled] == \
        [(a, 1, True), (b, 1, True), (c, 2, True)]
    h.run()


def test_long_prompt_is_chunked_and_samples_only_at_the_end(harness) -> None:
    h = harness(max_num_batched_tokens=8, max_model_len=64, num_kv_blocks=16)
    s = h.add(prompt(30), max_tokens=2, ignore_eos=True)
    chunks = []
    while s.num_output_tokens == 0:
        out, _ = h.step()
        ((row,),) = [out.scheduled]
        chunks.append((row.num_new_tokens, row.sample))
    assert chunks == [(8, False), (8, False), (8, False), (6, True)]
    assert s.num_computed_tokens == 30 and s.num_tokens == 31
    h.run()
    assert s.output_token_ids == expected_output(s, 2)


def test_prefix_cache_hit_skips_prefill_and_reports_cached_tokens(harness) -> None:
    h = harness(max_num_batched_tokens=64)
    a = h.add(prompt(14), max_tokens=1)
    h.run()
    b = h.add(prompt(12) + [7, 7, 7], max_tokens=1)
    out, _ = h.step()
    assert [(r.seq, r.num_new_tokens) for r in out.scheduled] == [(b, 3)]
    h.run()
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 12


# -- preemption ------------------------------------------------------------------------------

def test_preempts_newest_which_goes_to_front_and_recomputes(harness) -> None:
    # 6 blocks of 4 = 24 slots. a: 8-token prompt (2 blocks), b: 16 (4 blocks): full.
    h = harness(max_num_batched_tokens=64, num_kv_blocks=6, max_model_len=24)
    a = h.add(prompt(8), max_tokens=3, ignore_eos=True)
    b = h.add(prompt(16, 200), max_tokens=3, ignore_eos=True)
    out, _ = h.step()
    assert [r.seq for r in out.scheduled] == [a, b] and h.bm.num_free_blocks == 0
    d = h.add(prompt(4, 400), max_tokens=1)  # waits: no free block
    # a (older) decodes into a 3rd block: b, the newest running, is preempted.
    out, _ = h.step()
    assert out.preempted == [b]
    assert [r.seq for r in out.scheduled] == [a]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and b.num_preemptions == 1
    assert list(h.sched.waiting) == [b, d]  # in front of the request that was waiting
    assert h.bm.num_used_blocks == len(a.block_table) == 3
    out, _ = h.step()  # b's recompute (prompt + 1 output) does not fit yet: FIFO holds d too
    assert [r.seq for r in out.scheduled] == [a] and list(h.sched.waiting) == [b, d]
    out, _ = h.step()  # a finished last step; b recomputes past its 3 still-cached blocks
    assert [(r.seq, r.num_new_tokens, r.sample) for r in out.scheduled] == \
        [(b, 17 - 12, True), (d, 4, True)]
    h.run()
    assert [s.seq_id for s in h.finished] == [a.seq_id, d.seq_id, b.seq_id]
    # recompute from prompt + outputs so far: the output is as if never preempted
    assert b.output_token_ids == expected_output(b, 3) and b.finish_reason == "length"
    assert b.num_cached_tokens == 0  # first schedule's figure, though the recompute hit


def test_sequence_preempts_itself_when_it_is_the_newest(harness) -> None:
    # 8 blocks; three 8-token prompts use 6; the next boundary needs 3 blocks: only 2 free.
    h = harness(max_num_batched_tokens=64, num_kv_blocks=8, max_model_len=32)
    seqs = [h.add(prompt(8, 100 * (i + 1)), max_tokens=4, ignore_eos=True) for i in range(3)]
    h.step()
    out, _ = h.step()
    assert out.preempted == [seqs[2]]
    assert [r.seq for r in out.scheduled] == seqs[:2]
    h.run()
    for s in seqs:
        assert s.output_token_ids == expected_output(s, 4)
    assert [s.num_preemptions for s in seqs] == [0, 0, 1]


def test_lone_sequence_of_max_model_len_finishes_in_minimal_cache(any_harness) -> None:
    h = any_harness(max_num_batched_tokens=5, num_kv_blocks=10, max_model_len=40)
    s = h.add(prompt(23), max_tokens=100, ignore_eos=True)
    h.run()
    assert s.num_tokens == 40 and s.finish_reason == "length"
    assert s.output_token_ids == expected_output(s, 17)


# -- abort -----------------------------------------------------------------------------------

def test_abort_frees_blocks_at_once(harness) -> None:
    h = harness(max_num_batched_tokens=32, num_kv_blocks=8, max_model_len=32)
    a = h.add(prompt(20), max_tokens=10)
    b = h.add(prompt(8, 300), max_tokens=10)
    h.step()  # 5 + 2 blocks
    assert h.sched.num_running == 2 and h.bm.num_used_blocks == 7
    assert h.sched.abort(b.seq_id) is b
    assert b.finish_reason == "abort" and b.is_finished and b.block_table == []
    assert h.bm.num_used_blocks == len(a.block_table) == 5
    c = h.add(prompt(16, 500), max_tokens=2)  # 4 blocks; a's decode leaves only 2 free
    h.step()
    h.step()
    assert c.status is SequenceStatus.WAITING  # a holds blocks; c does not fit yet
    assert h.sched.abort(c.seq_id) is c and h.sched.num_waiting == 0
    assert h.sched.abort("nope") is None and h.sched.abort(c.seq_id) is None
    out = h.sched.schedule()  # aborted between schedule and postprocess: row skipped
    assert h.sched.abort(a.seq_id) is a and h.bm.all_free()
    tokens, computed = list(a.token_ids), a.num_computed_tokens
    assert h.sched.postprocess(out, [next_token(a, out.scheduled[0].output_index)]) == []
    assert (a.token_ids, a.num_computed_tokens, a.finish_reason) == (tokens, computed, "abort")
    assert not h.sched.has_unfinished()


# -- stop conditions -------------------------------------------------------------------------

def scripted(outputs: dict[str, list[int]]) -> TokenFn:
    return lambda seq, index: outputs[seq.seq_id][index]


def test_eos_stops_and_is_kept(any_harness) -> None:
    h = any_harness()
    s = h.add(prompt(5), seq_id="x", max_tokens=10)
    h.run(tokens=scripted({"x": [11, 12, EOS, 13]}))
    assert s.output_token_ids == [11, 12, EOS]
    assert (s.finish_reason, s.stop_reason) == ("stop", None)


def test_ignore_eos(any_harness) -> None:
    h = any_harness()
    s = h.add(prompt(5), seq_id="x", max_tokens=4, ignore_eos=True)
    h.run(tokens=scripted({"x": [EOS, EOS, 11, EOS]}))
    assert s.output_token_ids == [EOS, EOS, 11, EOS] and s.finish_reason == "length"


def test_stop_token_ids_set_stop_reason(any_harness) -> None:
    h = any_harness(eos=(EOS, 1001))
    s = h.add(prompt(5), seq_id="x", max_tokens=10, stop_token_ids=[1000], ignore_eos=True)
    t = h.add(prompt(5), seq_id="y", max_tokens=10, stop_token_ids=[1001])
    h.run(tokens=scripted({"x": [11, EOS, 1000, 12], "y": [1001, 11]}))
    assert s.output_token_ids == [11, EOS, 1000]
    assert (s.finish_reason, s.stop_reason) == ("stop", 1000)
    # a token that is both eos and a stop token reports the stop token
    assert (t.finish_reason, t.stop_reason) == ("stop", 1001)


def test_min_tokens_defers_eos_and_stop_tokens(any_harness) -> None:
    h = any_harness()
    s = h.add(prompt(5), seq_id="x", max_tokens=10, min_tokens=3)
    t = h.add(prompt(5), seq_id="y", max_tokens=10, min_tokens=2, stop_token_ids=[1000])
    h.run(tokens=scripted({"x": [EOS, EOS, EOS, 11], "y": [1000, 1000, 11]}))
    assert s.output_token_ids == [EOS, EOS, EOS] and s.finish_reason == "stop"
    assert t.output_token_ids == [1000, 1000] and t.stop_reason == 1000


def test_max_tokens_and_max_model_len(any_harness) -> None:
    h = any_harness(max_model_len=16, num_kv_blocks=4)
    s = h.add(prompt(5), max_tokens=3)
    t = h.add(prompt(13, 300), max_tokens=100)
    u = h.add(prompt(16, 400), max_tokens=100)  # a full-length prompt still gets one token
    h.run()
    assert s.num_output_tokens == 3 and s.finish_reason == "length"
    assert t.num_tokens == 16 and t.num_output_tokens == 3 and t.finish_reason == "length"
    assert u.num_output_tokens == 1 and u.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len=16"):
        h.add(prompt(17))


def test_postprocess_checks_sampled_rows(harness) -> None:
    h = harness(max_num_batched_tokens=4)
    s = h.add(prompt(6), max_tokens=1)
    out = h.sched.schedule()
    with pytest.raises(ValueError, match="sample=False"):
        h.sched.postprocess(out, [5])
    with pytest.raises(ValueError, match="sampled tokens for"):
        h.sched.postprocess(out, [])
    assert s.num_tokens == 6 and s.num_pending_tokens == 0  # nothing applied
    h.write_kv(out)
    h.sched.postprocess(out, [None])
    h.run()


def test_tokens_in_flight(harness) -> None:
    h = harness(max_num_batched_tokens=4)
    h.add(prompt(10), max_tokens=5, ignore_eos=True)
    h.add(prompt(3, 200), max_tokens=2, ignore_eos=True)
    assert h.sched.tokens_in_flight() == (10 + 5) + (3 + 2)
    h.step()  # 4 prompt tokens of the first
    assert h.sched.tokens_in_flight() == (6 + 5) + (3 + 2)
    h.step()  # 4 more prompt tokens of the first
    h.step()  # last 2 prompt tokens + first output; second request 2 tokens
    assert h.sched.tokens_in_flight() == (0 + 4) + (1 + 2)
    h.run()
    assert h.sched.tokens_in_flight() == 0


def test_tokens_in_flight_capped_by_max_model_len(harness) -> None:
    h = harness(max_num_batched_tokens=8, max_model_len=20)
    h.add(prompt(12), max_tokens=100, ignore_eos=True)
    h.add(prompt(2, 200), max_tokens=3, ignore_eos=True)
    assert h.sched.tokens_in_flight() == (12 + (20 - 12)) + (2 + 3)
    h.step()  # 8 prompt tokens of the first
    assert h.sched.tokens_in_flight() == (4 + 8) + (2 + 3)
    h.run()
    assert h.sched.tokens_in_flight() == 0


def test_add_rejects_duplicate_ids(harness) -> None:
    h = harness()
    first = h.add(prompt(3), seq_id="same")
    with pytest.raises(ValueError, match="already"):
        h.add(prompt(3), seq_id="same")
    assert h.sched.get("same") is first and h.sched.num_waiting == 1
    h.run()
    assert h.sched.get("same") is None
    h.add(prompt(3), seq_id="same", max_tokens=1)  # finished ids may come back
    h.run()


def test_random_workload_with_preemption_and_aborts(any_harness) -> None:
    rng = random.Random(1)
    h = any_harness(max_num_batched_tokens=24, max_num_seqs=5, num_kv_blocks=14, max_model_len=48)
    random_workload(h, rng)


def random_workload(h: Harness, rng: random.Random) -> None:
    """Arrivals sharing prefixes, aborts, KV pressure; checks every finished output."""
    shared = [rng.randrange(10, 900) for _ in range(16)]
    limits: dict[str, int] = {}
    aborted: set[str] = set()
    for step in range(400):
        if step < 200 and rng.random() < 0.3:
            n = rng.randint(1, 30)
            p = shared[:rng.randint(0, n)]
            p += [rng.randrange(10, 900) for _ in range(n - len(p))]
            s = h.add(p, max_tokens=rng.randint(1, 20), ignore_eos=True)
            limits[s.seq_id] = min(s.sampling_params.max_tokens, 48 - n)
        if rng.random() < 0.03 and h.sched.has_unfinished():
            victim = rng.choice(list(h.sched.waiting) + h.sched.running)
            assert h.sched.abort(victim.seq_id) is victim
            aborted.add(victim.seq_id)
        h.step()
    h.run()
    assert sum(s.num_preemptions for s in h.finished) > 0, "workload never preempted"
    assert any(s.num_cached_tokens > 0 for s in h.finished), "workload never hit the cache"
    for s in h.finished:
        assert s.seq_id not in aborted
        assert s.finish_reason == "length"
        assert s.output_token_ids == expected_output(s, limits[s.seq_id])


def test_block_table_cache_through_preemption_and_aborts(any_harness) -> None:
    """The model runner's block tables, packed through one cache across all steps, equal
    tables padded from scratch in every batch of a workload that grows, preempts, aborts
    and reuses blocks; the slots agree with the positions too."""
    h = any_harness(max_num_batched_tokens=24, max_num_seqs=5, num_kv_blocks=14, max_model_len=48)
    cache = BlockTableCache()
    seen = {"rows": 0, "preempted": 0}

    def check(out: SchedulerOutput) -> None:
        rows = out.scheduled
        seen["rows"] += len(rows)
        seen["preempted"] += len(out.preempted)
        if not rows:
            return
        tables = [r.seq.block_table for r in rows]
        query_lens = [r.num_new_tokens for r in rows]
        seq_lens = [r.start + r.num_new_tokens for r in rows]
        meta = make_attention_metadata(query_lens, seq_lens, tables, BS, pad_block_id=-1,
                                       table_cache=cache)
        width = max(len(t) for t in tables)
        assert meta.block_tables.tolist() == [t + [-1] * (width - len(t)) for t in tables]
        assert meta.slot_mapping.tolist() == [
            t[pos // BS] * BS + pos % BS
            for t, q, n in zip(tables, query_lens, seq_lens, strict=True)
            for pos in range(n - q, n)]

    h.on_schedule = check
    random_workload(h, random.Random(2))
    assert seen["rows"] > 100 and seen["preempted"] > 0
