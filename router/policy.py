"""Routing policies: pure functions from engine figures to a choice.

Units: `load` is an engine's tokens in flight (Load.tokens_in_flight, plus what this
router has sent since the engine last reported), the same unit as uncached prompt tokens,
so `cost = uncached_prompt_tokens * cache_weight + load` adds like with like.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("prefix", "least-load", "round-robin")

# Routing reasons (a metrics label and a log field).
REASON_PREFIX_HIT = "prefix_hit"      # lowest cost, and the winner holds part of the prompt
REASON_PREFIX_MISS = "prefix_miss"    # lowest cost, no cached prefix on the winner
REASON_LOAD_GUARD = "load_guard"      # the cost winner was far busier than the least loaded
REASON_LEAST_LOAD = "least_load"
REASON_ROUND_ROBIN = "round_robin"
# Not the policy's: a later attempt of a request, whichever engine the policy picked.
REASON_RETRY = "retry"                # after an engine failed before any token went out
REASON_CONTINUATION = "continuation"  # after an engine failed mid-stream


@dataclass(frozen=True)
class Candidate:
    """One healthy engine as the policy sees it."""

    key: str             # the router's engine key (its address)
    load: float          # tokens in flight
    cached_tokens: int   # leading prompt tokens this engine holds (full blocks × block size)


@dataclass(frozen=True)
class PolicyConfig:
    policy: str = "prefix"
    cache_weight: float = 1.0
    # The guard fires when the cost winner's load exceeds both ratio × the least load and
    # the least load + min_gap tokens. ratio 0 turns the guard off.
    load_guard_ratio: float = 2.0
    load_guard_min: float = 2048.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.cache_weight < 0:
            raise ValueError(f"cache_weight must be >= 0, got {self.cache_weight!r}")
        if self.load_guard_ratio != 0 and self.load_guard_ratio < 1:
            raise ValueError(
                f"load_guard_ratio must be >= 1 (or 0 = off), got {self.load_guard_ratio!r}")
        if self.load_guard_min < 0:
            raise ValueError(f"load_guard_min must be >= 0, got {self.load_guard_min!r}")


@dataclass(frozen=True)
class Decision:
    key: str
    reason: str
    cost: float  # the winner's prefix cost (its load for least-load / round-robin)


def prefix_cost(candidate: Candidate, prompt_tokens: int, cache_weight: float) -> float:
    uncached = max(prompt_tokens - candidate.cached_tokens, 0)
    return uncached * cache_weight + candidate.load


def _pick_min(candidates: Sequence[Candidate], key, rng: random.Random) -> Candidate:
    best = min(key(c) for c in candidates)
    return rng.choice([c for c in candidates if key(c) == best])


def least_load(candidates: Sequence[Candidate], rng: random.Random) -> Decision:
    c = _pick_min(candidates, lambda c: c.load, rng)
    return Decision(c.key, REASON_LEAST_LOAD, c.load)


def round_robin(candidates: Sequence[Candidate], counter: int) -> Decision:
    ordered = sorted(candidates, key=lambda c: c.key)
    c = ordered[counter % len(ordered)]
    return Decision(c.key, REASON_ROUND_ROBIN, c.load)


def guard_fires(winner: Candidate, candidates: Sequence[Candidate], ratio: float,
                min_gap: float) -> bool:
    """True when the winner is far busier than the least-loaded engine."""
    if ratio == 0:
        return False
    lightest = min(c.load for c in candidates)
    return winner.load > ratio * lightest and winner.load - lightest > min_gap


def prefix(candidates: Sequence[Candidate], prompt_tokens: int, config: PolicyConfig,
           rng: random.Random) -> Decision:
    """Lowest cost wins; ties by load, then at random; then the load-imbalance guard."""
    costs = {c.key: prefix_cost(c, prompt_tokens, config.cache_weight) for c in candidates}
    winner = _pick_min(candidates, lambda c: (costs[c.key], c.load), rng)
    if guard_fires(winner, candidates, config.load_guard_ratio, config.load_guard_min):
        c = _pick_min(candidates, lambda c: c.load, rng)
        return Decision(c.key, REASON_LOAD_GUARD, costs[c.key])
    reason = REASON_PREFIX_HIT if winner.cached_tokens > 0 else REASON_PREFIX_MISS
    return Decision(winner.key, reason, costs[winner.key])


def choose(candidates: Sequence[Candidate], prompt_tokens: int, config: PolicyConfig,
           rng: random.Random, counter: int) -> Decision:
    """Pick one of `candidates` (non-empty) by `config.policy`; `counter` feeds round-robin."""
    if not candidates:
        raise ValueError("choose() needs at least one candidate")
    if config.policy == "least-load":
        return least_load(candidates, rng)
    if config.policy == "round-robin":
        return round_robin(candidates, counter)
    return prefix(candidates, prompt_tokens, config, rng)
