"""Block manager: chained prefix cache, ref counts, LRU reuse, hash confirmation, KV events."""

from __future__ import annotations

import random
from array import array
from collections.abc import Iterator

import pytest
import xxhash

from engine_service import block_manager as bm_module
from engine_service.block_manager import BlockManager, KvEvent
from engine_service.common.block_hash import hash_prompt_blocks
from engine_service.common.sampling_params import SamplingParams
from engine_service.sequence import Sequence
from tests.helpers import check_block_manager

_ids = iter(range(10**9))


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(f"s{next(_ids)}", tokens, SamplingParams())


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> None:
    """What a step does to the cache: allocate n tokens (default: all the rest), compute them."""
    if n is None:
        n = seq.num_tokens - (seq.num_computed_tokens if seq.block_table
                              else bm.get_num_cached_tokens(seq))
    bm.allocate(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def replay(events: list[KvEvent], into: set[int] | None = None) -> set[int]:
    held = set() if into is None else into
    for ev in events:
        for h in ev.block_hashes:
            if ev.kind == "stored":
                assert h not in held, "stored twice without a removal in between"
                held.add(h)
            else:
                assert h in held, "removed a hash that was never stored"
                held.remove(h)
    return held


def manual_chain(tokens: list[int], block_size: int) -> list[int]:
    """Independent reference for the chain: xxh3_64(parent u64 LE || tokens u32 LE)."""
    out, parent = [], 0xFFFFFFFFFFFFFFFF
    for start in range(0, len(tokens) - block_size + 1, block_size):
        data = parent.to_bytes(8, "little") + array("I", tokens[start:start + block_size]).tobytes()
        parent = xxhash.xxh3_64_intdigest(data)
        out.append(parent)
    return out


@pytest.fixture
def managers() -> Iterator[list[BlockManager]]:
    """Collects the managers a test builds and checks they end consistent and all free."""
    made: list[BlockManager] = []
    yield made
    for bm in made:
        check_block_manager(bm)
        assert bm.all_free(), "a test left blocks referenced"
        assert bm.num_used_blocks == 0


@pytest.fixture
def new_bm(managers: list[BlockManager]):
    def make(num_blocks: int, block_size: int) -> BlockManager:
        bm = BlockManager(num_blocks, block_size)
        managers.append(bm)
        return bm

    return make


def test_hash_chain_matches_router_and_reference(new_bm) -> None:
    bm = new_bm(16, 4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # 2 full blocks + 3 tokens
    a = make_seq(prompt)
    compute(bm, a)
    assert bm.cached_block_hashes() == manual_chain(prompt, 4)
    assert bm.cached_block_hashes() == hash_prompt_blocks(prompt, 4)  # what the router sends
    bm.free(a)

    same_prefix = manual_chain(prompt[:8] + [99, 98, 97, 96], 4)
    assert same_prefix[:2] == manual_chain(prompt, 4)[:2]
    changed_head = manual_chain([0] + prompt[1:], 4)
    # A different earlier block changes every later hash, even with equal later tokens.
    assert changed_head[0] != manual_chain(prompt, 4)[0]
    assert changed_head[1] != manual_chain(prompt, 4)[1]
    assert hash_prompt_blocks([0] + prompt[1:], 4) == changed_head


def test_prefix_hit_shares_blocks_with_ref_counts(new_bm) -> None:
    bm = new_bm(16, 4)
    a = make_seq(list(range(1, 11)))  # 10 tokens: blocks [1-4] [5-8] [9,10]
    compute(bm, a)
    b = make_seq(list(range(1, 9)) + [50, 51, 52])
    assert bm.get_num_cached_tokens(b) == 8
    assert b.block_table == [] and b.num_computed_tokens == 0  # the query is pure
    free_before = bm.num_free_blocks
    bm.allocate(b, 3)
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2, 1]
    assert bm.num_free_blocks == free_before - 1
    assert bm.take_events()[-1] == KvEvent("stored", hash_prompt_blocks(a.token_ids, 4))
    b.num_computed_tokens += 3
    bm.cache_full_blocks(b)
    assert bm.take_events() == []  # b's third block is partial; nothing new is full
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1, 1]
    bm.free(b)


def test_cap_leaves_one_token_to_compute(new_bm) -> None:
    bm = new_bm(16, 4)
    a = make_seq(list(range(1, 10)))  # 9 tokens: 2 full blocks cached
    compute(bm, a)
    assert len(bm.cached_block_hashes()) == 2
    exact = make_seq(list(range(1, 9)))  # exactly the 2 cached blocks
    assert bm.get_num_cached_tokens(exact) == 4  # (8 - 1) // 4 = 1 block
    longer = make_seq(list(range(1, 10)))
    assert bm.get_num_cached_tokens(longer) == 8
    tiny = make_seq([1, 2, 3, 4])
    assert bm.get_num_cached_tokens(tiny) == 0
    bm.allocate(exact, 4)
    assert exact.num_computed_tokens == 4 and len(exact.block_table) == 2
    bm.free(a)
    bm.free(exact)


def test_recomputed_sequence_looks_up_outputs_too(new_bm) -> None:
    bm = new_bm(16, 4)
    a = make_seq([1, 2, 3, 4, 5, 6])
    compute(bm, a)
    for t in (7, 8, 9):  # decode three tokens: the block [5..8] fills and gets hashed
        a.token_ids.append(t)
        compute(bm, a, 1)
    a.token_ids.append(10)  # sampled, not computed yet
    assert bm.cached_block_hashes() == hash_prompt_blocks(list(range(1, 9)), 4)
    bm.free(a)
    a.num_computed_tokens, a.num_preemptions, cached_first = 0, 1, a.num_cached_tokens
    assert bm.get_num_cached_tokens(a) == 8  # prompt + outputs: 10 tokens, 2 blocks cached
    bm.allocate(a, 2)
    assert a.num_computed_tokens == 8
    assert a.num_cached_tokens == cached_first == 0  # keeps the first schedule's figure
    bm.free(a)


def test_hash_collision_is_confirmed_against_tokens(new_bm, monkeypatch) -> None:
    # Every block at the same depth collides: the hash depends on the parent only.
    monkeypatch.setattr(bm_module, "hash_block",
                        lambda parent, tokens: 7 if parent is None else parent + 1)
    bm = new_bm(16, 4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a)
    assert sorted(bm.cached_block_hashes()) == [7, 8]
    other = make_seq([9, 9, 9, 9, 9, 9, 9, 9, 9])
    assert bm.get_num_cached_tokens(other) == 0  # same hashes, different tokens: a miss
    half = make_seq([1, 2, 3, 4, 0, 0, 0, 0, 0])
    assert bm.get_num_cached_tokens(half) == 4
    compute(bm, other)
    # other's blocks collide with a's entries: the existing mapping stays, no new events.
    assert [bm.blocks[i].block_hash for i in other.block_table] == [None, None, None]
    assert sorted(bm.cached_block_hashes()) == [7, 8]
    check_block_manager(bm)
    for s in (a, other):
        bm.free(s)


def test_duplicate_concurrent_blocks_stay_private(new_bm) -> None:
    bm = new_bm(16, 4)
    prompt = list(range(20, 29))
    a, b = make_seq(prompt), make_seq(prompt)
    bm.allocate(a, 9)  # both admitted before either computed: no hits
    bm.allocate(b, 9)
    assert set(a.block_table).isdisjoint(b.block_table)
    for s in (a, b):
        s.num_computed_tokens = 9
        bm.cache_full_blocks(s)
    assert [bm.blocks[i].block_hash for i in b.block_table] == [None, None, None]
    assert bm.take_events() == [KvEvent("stored", hash_prompt_blocks(prompt, 4))]
    bm.free(a)
    bm.free(b)
    check_block_manager(bm)
    c = make_seq(prompt)
    assert bm.get_num_cached_tokens(c) == 8


def test_lru_reuse_freed_first_and_tail_first(new_bm) -> None:
    bm = new_bm(4, 2)
    a, b = make_seq([1, 2, 3, 4]), make_seq([5, 6, 7, 8])
    compute(bm, a)
    compute(bm, b)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    ha, hb = hash_prompt_blocks(a.token_ids, 2), hash_prompt_blocks(b.token_ids, 2)
    bm.take_events()
    bm.free(a)  # freed first, tail first: reuse order 1, 0, then b's 3, 2
    bm.free(b)
    assert bm.num_free_blocks == 4 and set(bm.cached_block_hashes()) == set(ha + hb)
    c = make_seq([10, 11, 12])
    compute(bm, c)
    assert c.block_table == [1, 0]
    assert bm.take_events() == [KvEvent("removed", [ha[1], ha[0]]),
                                KvEvent("stored", hash_prompt_blocks(c.token_ids, 2))]
    assert bm.get_num_cached_tokens(make_seq([1, 2, 3, 4, 5])) == 0
    assert bm.get_num_cached_tokens(make_seq([5, 6, 7, 8, 9])) == 4
    d = make_seq([20, 21, 22])
    compute(bm, d)
    assert d.block_table == [3, 2]
    assert bm.take_events()[0] == KvEvent("removed", [hb[1], hb[0]])
    bm.free(c)
    bm.free(d)


def test_unhashed_blocks_are_reused_before_cached_ones(new_bm) -> None:
    bm = new_bm(3, 2)
    h = make_seq([1, 2, 3])  # blocks 0: [1, 2] (hashed), 1: [3] (partial, never hashed)
    u = make_seq([7])  # block 2, never hashed
    compute(bm, h)
    compute(bm, u)
    bm.take_events()
    bm.free(h)
    bm.free(u)  # freed last, but holds nothing reusable: goes first
    c = make_seq([8, 8, 8])
    bm.allocate(c, 3)
    assert c.block_table == [2, 1]
    assert bm.take_events() == []  # the cached block survived
    assert bm.cached_block_hashes() == hash_prompt_blocks([1, 2], 2)
    bm.free(c)


def test_hit_on_free_cached_block_revives_it_without_eviction(new_bm) -> None:
    bm = new_bm(8, 2)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a)
    bm.free(a)
    bm.take_events()
    assert bm.num_free_blocks == 8
    b = make_seq([1, 2, 3, 4, 9, 9])
    bm.allocate(b, 2)
    assert b.num_cached_tokens == 4
    assert bm.num_free_blocks == 8 - 3  # two revived hits, one fresh
    assert bm.take_events() == []  # nothing was evicted
    assert set(hash_prompt_blocks([1, 2, 3, 4], 2)) <= set(bm.cached_block_hashes())
    bm.free(b)


class _CountingTable(dict):
    gets = 0

    def get(self, key, default=None):
        type(self).gets += 1
        return super().get(key, default)


def test_admission_looks_up_the_prefix_once_until_the_cache_changes(new_bm) -> None:
    """The scheduler asks get_num_cached_tokens, can_allocate and allocate in a row; one
    walk of the hash table serves all three, and a cache change made without any lookup
    (a running sequence's growth evicting blocks, its full blocks being stored) is seen."""
    bm = new_bm(6, 2)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a)
    bm.free(a)  # [1, 2] and [3, 4] stay cached in free blocks
    c = make_seq([7] * 11)
    compute(bm, c, 1)  # running, one block
    bm.hash_to_block = table = _CountingTable(bm.hash_to_block)
    b = make_seq([1, 2, 3, 4, 9])
    assert bm.get_num_cached_tokens(b) == 4
    walks = table.gets
    assert bm.can_allocate(b, 1)
    assert bm.get_num_cached_tokens(b) == 4 and table.gets == walks
    bm.allocate(c, 10)  # a running sequence grows: takes every free block, both cached ones
    assert bm.get_num_cached_tokens(b) == 0, "the evictions were not seen"
    bm.free(c)
    e = make_seq([1, 2, 3, 4, 6])
    bm.allocate(e, 5)
    assert bm.get_num_cached_tokens(b) == 0
    e.num_computed_tokens += 5
    bm.cache_full_blocks(e)  # stores [1, 2] and [3, 4] again
    assert bm.get_num_cached_tokens(b) == 4, "the stored blocks were not seen"
    # A new request reusing b's id and length, with other tokens, gets its own answer.
    other = Sequence(b.seq_id, [5, 5, 5, 5, 9], SamplingParams())
    assert bm.get_num_cached_tokens(other) == 0, "answered from another sequence's memo"
    bm.free(e)


def test_decode_grows_block_table_at_boundaries(new_bm) -> None:
    bm = new_bm(8, 4)
    s = make_seq([1, 2, 3])
    compute(bm, s)
    sizes = []
    for t in range(10, 20):
        s.token_ids.append(t)
        compute(bm, s, 1)
        sizes.append(len(s.block_table))
    # after each step the table covers exactly ceil(computed / 4) blocks
    assert sizes == [-(-n // 4) for n in range(4, 14)]
    assert len(bm.cached_block_hashes()) == 3
    bm.free(s)


def test_cannot_allocate_leaves_no_state(new_bm) -> None:
    bm = new_bm(3, 2)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a)  # uses all 3 blocks
    bm.free(a)
    bm.take_events()
    b = make_seq([1, 2, 3, 4, 9, 9, 9])
    assert bm.get_num_cached_tokens(b) == 4
    # 2 revived hits + 2 fresh blocks for 3 tokens > 3 free blocks
    assert not bm.can_allocate(b, 3)
    snapshot = (list(bm.free_blocks), dict(bm.hash_to_block),
                [(x.ref_count, x.block_hash) for x in bm.blocks])
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(b, 3)
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.num_cached_tokens == 0
    assert snapshot == (list(bm.free_blocks), dict(bm.hash_to_block),
                        [(x.ref_count, x.block_hash) for x in bm.blocks])
    assert bm.take_events() == []
    assert bm.can_allocate(b, 2)  # 2 hits + 1 fresh fits
    bm.allocate(b, 2)
    assert bm.num_free_blocks == 0
    c = make_seq([8])
    assert not bm.can_allocate(c, 1)
    with pytest.raises(RuntimeError):
        bm.allocate(c, 1)
    assert c.block_table == []
    bm.free(b)


def test_allocate_rejects_more_tokens_than_known(new_bm) -> None:
    bm = new_bm(4, 2)
    s = make_seq([1, 2, 3])
    with pytest.raises(ValueError, match="cannot allocate 4 new tokens"):
        bm.allocate(s, 4)
    with pytest.raises(ValueError):
        bm.allocate(s, 0)
    assert s.block_table == [] and bm.all_free()


def test_events_replay_equals_snapshot_under_random_churn(new_bm) -> None:
    rng = random.Random(0)
    bm = new_bm(24, 4)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    live: list[Sequence] = []
    held: set[int] = set()
    for _ in range(400):
        if live and (rng.random() < 0.4 or bm.num_free_blocks < 6):
            bm.free(live.pop(rng.randrange(len(live))))
        elif live and rng.random() < 0.5:
            s = rng.choice(live)  # decode one token (its last token is uncomputed)
            if bm.can_allocate(s, 1):
                compute(bm, s, 1)
                s.token_ids.append(rng.randrange(50))
        else:
            tokens = rng.choice(prefixes)[:rng.randint(0, 12)] + \
                [rng.randrange(50) for _ in range(rng.randint(1, 10))]
            s = make_seq(tokens)
            chunk = s.num_tokens - bm.get_num_cached_tokens(s) - 1
            if chunk >= 1 and bm.can_allocate(s, chunk):
                compute(bm, s, chunk)  # prefill all but the last token, as after a sample
                live.append(s)
        check_block_manager(bm)
        replay(bm.take_events(), held)
        assert held == set(bm.cached_block_hashes())
        for s in live:  # every hashed block in use really holds the tokens it claims
            for i, block_id in enumerate(s.block_table):
                block = bm.blocks[block_id]
                if block.block_hash is not None:
                    assert list(block.token_ids) == s.token_ids[i * 4:(i + 1) * 4]
    for s in live:
        bm.free(s)


def test_kv_event_kind_is_validated() -> None:
    with pytest.raises(ValueError, match="kind"):
        KvEvent("evicted", [1])  # type: ignore[arg-type]
