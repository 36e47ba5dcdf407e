"""Routing policies (router.policy) and the prefix index (router.prefix_index): pure logic."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.policy import (
    REASON_LEAST_LOAD,
    REASON_LOAD_GUARD,
    REASON_PREFIX_HIT,
    REASON_PREFIX_MISS,
    REASON_ROUND_ROBIN,
    Candidate,
    PolicyConfig,
    choose,
)
from router.prefix_index import ApplyResult, PrefixIndex
from tests.router_helpers import index_counts

PREFIX = PolicyConfig(policy="prefix", cache_weight=1.0, load_guard_ratio=0)


def pick(candidates, prompt_tokens, config=PREFIX, seed=0, counter=0):
    return choose(candidates, prompt_tokens, config, random.Random(seed), counter)


# ---- prefix policy ----------------------------------------------------------------------


def test_prefix_winner_holds_the_prompt():
    cands = [Candidate("a", load=0, cached_tokens=0), Candidate("b", load=0, cached_tokens=64),
             Candidate("c", load=0, cached_tokens=16)]
    d = pick(cands, 100)
    assert d.key == "b"
    assert d.reason == REASON_PREFIX_HIT
    assert d.cost == (100 - 64) * 1.0 + 0


def test_prefix_cost_trades_cache_against_load():
    # b holds 64 of 100 tokens but has 100 tokens in flight: 36 + 100 > 100 + 0.
    cands = [Candidate("a", load=0, cached_tokens=0), Candidate("b", load=100, cached_tokens=64)]
    d = pick(cands, 100)
    assert (d.key, d.reason) == ("a", REASON_PREFIX_MISS)
    # A heavier cache weight makes the cached prefix worth more than the load.
    heavy = PolicyConfig(policy="prefix", cache_weight=4.0, load_guard_ratio=0)
    d = pick(cands, 100, heavy)
    assert d.key == "b"
    assert d.cost == 36 * 4.0 + 100


def test_prefix_tie_on_cost_goes_to_lower_load():
    # cost a = 90 + 20 = 110, cost b = 100 + 10 = 110: equal, b has less load.
    cands = [Candidate("a", load=20, cached_tokens=10), Candidate("b", load=10, cached_tokens=0)]
    for seed in range(20):
        assert pick(cands, 100, seed=seed).key == "b"


def test_prefix_full_tie_is_random():
    cands = [Candidate(k, load=5, cached_tokens=8) for k in "abc"]
    rng = random.Random(1)
    seen = Counter(choose(cands, 50, PREFIX, rng, 0).key for _ in range(300))
    assert set(seen) == {"a", "b", "c"}


def test_load_guard_sends_to_least_loaded():
    # a holds the whole 10000-token prompt: cost 0 + 5000 beats b's 10000 + 0 and c's.
    cands = [Candidate("a", load=5000, cached_tokens=10000),
             Candidate("b", load=100, cached_tokens=0), Candidate("c", load=300, cached_tokens=0)]
    off = PolicyConfig(policy="prefix", load_guard_ratio=0)
    assert pick(cands, 10000, off).key == "a"
    guard = PolicyConfig(policy="prefix", load_guard_ratio=2.0, load_guard_min=2048)
    d = pick(cands, 10000, guard)
    assert (d.key, d.reason) == ("b", REASON_LOAD_GUARD)


@pytest.mark.parametrize("ratio,min_gap,fires", [
    (2.0, 2048, True),     # 5000 > 2 x 100 and 5000 - 100 > 2048
    (60.0, 2048, False),   # 5000 < 60 x 100
    (2.0, 4900, False),    # gap 4900 is not above 4900
    (2.0, 4899, True),
])
def test_load_guard_thresholds(ratio, min_gap, fires):
    cands = [Candidate("a", load=5000, cached_tokens=10000),
             Candidate("b", load=100, cached_tokens=0)]
    cfg = PolicyConfig(policy="prefix", load_guard_ratio=ratio, load_guard_min=min_gap)
    d = pick(cands, 10000, cfg)
    assert d.key == ("b" if fires else "a")
    assert (d.reason == REASON_LOAD_GUARD) is fires


def test_load_guard_leaves_a_lightly_loaded_winner_alone():
    # The busy engine is not the winner: no reason to override the cache choice.
    cands = [Candidate("a", load=10, cached_tokens=64), Candidate("b", load=9000, cached_tokens=0),
             Candidate("c", load=0, cached_tokens=0)]
    cfg = PolicyConfig(policy="prefix", load_guard_ratio=2.0, load_guard_min=100)
    d = pick(cands, 80, cfg)
    assert (d.key, d.reason) == ("a", REASON_PREFIX_HIT)


# ---- least-load and round-robin ---------------------------------------------------------


def test_least_load_ignores_cache():
    cands = [Candidate("a", load=50, cached_tokens=1000), Candidate("b", load=7, cached_tokens=0),
             Candidate("c", load=9, cached_tokens=0)]
    d = pick(cands, 1000, PolicyConfig(policy="least-load"))
    assert (d.key, d.reason) == ("b", REASON_LEAST_LOAD)


def test_least_load_ties_are_random():
    cands = [Candidate("a", load=3, cached_tokens=0), Candidate("b", load=3, cached_tokens=0),
             Candidate("c", load=4, cached_tokens=0)]
    rng = random.Random(2)
    cfg = PolicyConfig(policy="least-load")
    seen = Counter(choose(cands, 10, cfg, rng, 0).key for _ in range(200))
    assert set(seen) == {"a", "b"}


def test_round_robin_cycles_in_key_order():
    cands = [Candidate(k, load=0, cached_tokens=0) for k in ("c", "a", "b")]
    cfg = PolicyConfig(policy="round-robin")
    picks = [pick(cands, 10, cfg, counter=i) for i in range(6)]
    assert [d.key for d in picks] == ["a", "b", "c", "a", "b", "c"]
    assert {d.reason for d in picks} == {REASON_ROUND_ROBIN}


def test_policy_config_validation():
    with pytest.raises(ValueError, match="policy"):
        PolicyConfig(policy="fastest")
    with pytest.raises(ValueError, match="cache_weight"):
        PolicyConfig(cache_weight=-1)
    with pytest.raises(ValueError, match="load_guard_ratio"):
        PolicyConfig(load_guard_ratio=0.5)
    with pytest.raises(ValueError, match="load_guard_min"):
        PolicyConfig(load_guard_min=-1)
    with pytest.raises(ValueError, match="candidate"):
        pick([], 10)


# ---- prefix index -------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_snapshot_replaces_what_was_known():
    index = PrefixIndex()
    index.apply_snapshot("e", 5, [11, 12, 13])
    assert index.match("e", [11, 12, 13, 14]) == 3
    assert index.resume_point("e") == 5
    index.apply_snapshot("e", 9, [21])
    assert index.match("e", [11, 12]) == 0
    assert index.match("e", [21, 22]) == 1
    assert index.resume_point("e") == 9
    assert index.match("other", [21]) == 0


def test_match_counts_leading_blocks_only():
    index = PrefixIndex()
    index.apply_snapshot("e", 1, [1, 3])
    assert index.match("e", [1, 2, 3]) == 1
    assert index.match("e", [2, 3]) == 0


def test_deltas_store_and_remove():
    index = PrefixIndex()
    index.apply_snapshot("e", 0, [])
    # one sequence number per batch, whatever it holds
    assert index.apply_delta("e", 1, stored=[1, 2], removed=[]) is ApplyResult.APPLIED
    assert index.match("e", [1, 2]) == 2
    assert index.apply_delta("e", 2, stored=[], removed=[1]) is ApplyResult.APPLIED
    assert index.match("e", [1, 2]) == 0
    assert index.match("e", [2]) == 1
    assert index.resume_point("e") == 2
    # removed is applied before stored (evict on allocation, then store after the step)
    assert index.apply_delta("e", 3, stored=[7], removed=[7]) is ApplyResult.APPLIED
    assert index.match("e", [7]) == 1


def test_one_lost_batch_is_a_gap():
    # A batch of several hashes still counts one: skipping a number means a lost batch.
    index = PrefixIndex()
    index.apply_snapshot("e", 4, [])
    assert index.apply_delta("e", 5, stored=[1, 2, 3], removed=[]) is ApplyResult.APPLIED
    assert index.apply_delta("e", 7, stored=[4, 5], removed=[]) is ApplyResult.GAP


def test_gap_resets_and_asks_for_a_snapshot():
    index = PrefixIndex()
    index.apply_snapshot("e", 10, [1, 2])
    result = index.apply_delta("e", 15, stored=[3], removed=[])  # 11..14 missing
    assert result is ApplyResult.GAP
    assert index.resume_point("e") == 0
    assert not index.has_snapshot("e")
    assert index.match("e", [1, 2]) == 0
    # until the new snapshot arrives, deltas are refused
    assert index.apply_delta("e", 16, stored=[4], removed=[]) is ApplyResult.NO_SNAPSHOT
    assert index.apply_batch("e", 20, True, [1, 2, 3], []) is ApplyResult.APPLIED
    assert index.match("e", [1, 2, 3]) == 3
    assert index.resume_point("e") == 20


def test_stream_going_backwards_is_a_gap():
    index = PrefixIndex()
    index.apply_snapshot("e", 10, [1])
    assert index.apply_delta("e", 3, stored=[2], removed=[]) is ApplyResult.GAP


def test_optimistic_entries_expire_unless_confirmed():
    clock = FakeClock()
    index = PrefixIndex(optimistic_ttl_s=5.0, clock=clock)
    index.apply_snapshot("e", 0, [])
    index.insert_optimistic("e", [1, 2, 3])
    assert index.match("e", [1, 2, 3]) == 3
    assert index_counts(index, "e") == (0, 3)
    index.apply_delta("e", 1, stored=[1, 2], removed=[])  # the engine confirms two
    assert index_counts(index, "e") == (2, 1)
    clock.now += 5.0
    assert index.match("e", [1, 2, 3]) == 2  # the unconfirmed third expired
    index.expire()
    assert index_counts(index, "e") == (2, 0)


def test_expire_drops_only_lapsed_optimistic_entries():
    """expire() on its own (no match() touching the entries first) frees lapsed optimistic
    hashes of every engine and keeps the live and the confirmed ones."""
    clock = FakeClock()
    index = PrefixIndex(optimistic_ttl_s=5.0, clock=clock)
    for engine in ("a", "b"):
        index.apply_snapshot(engine, 0, [100])
        index.insert_optimistic(engine, [1, 2, 3])
    clock.now += 3.0
    index.insert_optimistic("b", [7, 8])  # lapses 3 s after the others
    index.expire()
    assert index_counts(index, "a") == (1, 3) and index_counts(index, "b") == (1, 5)
    clock.now += 2.0  # the first three of each engine lapse now (expiry <= now)
    index.expire()
    assert index_counts(index, "a") == (1, 0)
    assert index_counts(index, "b") == (1, 2)
    assert index.match("b", [7, 8]) == 2 and index.match("a", [100]) == 1
    clock.now += 3.0
    index.expire()
    assert index_counts(index, "b") == (1, 0)


def test_optimistic_entry_dropped_by_removal_and_kept_across_snapshot():
    clock = FakeClock()
    index = PrefixIndex(optimistic_ttl_s=5.0, clock=clock)
    index.apply_snapshot("e", 0, [])
    index.insert_optimistic("e", [1, 2])
    index.apply_delta("e", 1, stored=[], removed=[2])
    assert index.match("e", [1, 2]) == 1
    index.apply_snapshot("e", 7, [9])  # the engine has not prefilled 1 yet
    assert index.match("e", [1]) == 1
    assert index.match("e", [9]) == 1
    index.expire()
    clock.now += 6
    assert index.match("e", [1]) == 0


def test_remove_engine_forgets_it():
    index = PrefixIndex()
    index.apply_snapshot("e", 3, [1])
    index.remove_engine("e")
    assert index.match("e", [1]) == 0
    assert index.resume_point("e") == 0
