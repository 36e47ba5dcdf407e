"""What each engine holds in its prefix cache, as the router knows it: the confirmed block
hashes of its SubscribeKvEvents stream, plus optimistic entries inserted when a prompt is
sent there, until a `stored` event confirms them or `optimistic_ttl_s` passes."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum


class ApplyResult(Enum):
    APPLIED = "applied"
    # Events were missed; the index for this engine is reset and needs a new snapshot.
    GAP = "gap"
    # A delta arrived before any snapshot; nothing was applied.
    NO_SNAPSHOT = "no_snapshot"


@dataclass
class _EngineEntry:
    confirmed: set[int] = field(default_factory=set)
    optimistic: dict[int, float] = field(default_factory=dict)  # hash -> expiry (clock s)
    last_sequence: int = 0
    has_snapshot: bool = False


class PrefixIndex:
    """Per-engine block-hash sets; keys are the router's engine keys (addresses)."""

    def __init__(self, optimistic_ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if optimistic_ttl_s < 0:
            raise ValueError(f"optimistic_ttl_s must be >= 0, got {optimistic_ttl_s!r}")
        self.optimistic_ttl_s = optimistic_ttl_s
        self._clock = clock
        self._engines: dict[str, _EngineEntry] = {}

    def _entry(self, engine: str) -> _EngineEntry:
        entry = self._engines.get(engine)
        if entry is None:
            entry = self._engines[engine] = _EngineEntry()
        return entry

    # ---- KV events --------------------------------------------------------------------

    def apply_snapshot(self, engine: str, sequence_number: int, hashes: Iterable[int]) -> None:
        """Replace everything known about `engine` with the snapshot's hashes."""
        entry = self._entry(engine)
        entry.confirmed = set(hashes)
        # Optimistic entries survive a snapshot: they stand for requests the engine may not
        # have prefilled yet when it took the snapshot.
        for h in entry.confirmed.intersection(entry.optimistic):
            del entry.optimistic[h]
        entry.last_sequence = sequence_number
        entry.has_snapshot = True

    def apply_delta(self, engine: str, sequence_number: int, stored: Sequence[int],
                    removed: Sequence[int]) -> ApplyResult:
        """A delta continues the stream only at sequence number last + 1. Removed first, then
        stored: a block manager's order within one step (evict on allocation, store after)."""
        entry = self._entry(engine)
        if not entry.has_snapshot:
            return ApplyResult.NO_SNAPSHOT
        if sequence_number != entry.last_sequence + 1:
            # Lost events, or a stream that went backwards (the engine restarted): either
            # way what we hold can no longer be trusted.
            self.reset(engine)
            return ApplyResult.GAP
        for h in removed:
            entry.confirmed.discard(h)
            entry.optimistic.pop(h, None)
        for h in stored:
            entry.confirmed.add(h)
            entry.optimistic.pop(h, None)
        entry.last_sequence = sequence_number
        return ApplyResult.APPLIED

    def apply_batch(self, engine: str, sequence_number: int, snapshot: bool,
                    stored: Sequence[int], removed: Sequence[int]) -> ApplyResult:
        """Apply one KvEventBatch's fields."""
        if snapshot:
            self.apply_snapshot(engine, sequence_number, stored)
            return ApplyResult.APPLIED
        return self.apply_delta(engine, sequence_number, stored, removed)

    def resume_point(self, engine: str) -> int:
        """`after_sequence_number` for the next SubscribeKvEvents (0 = ask for a snapshot)."""
        entry = self._engines.get(engine)
        if entry is None or not entry.has_snapshot:
            return 0
        return entry.last_sequence

    def has_snapshot(self, engine: str) -> bool:
        entry = self._engines.get(engine)
        return entry is not None and entry.has_snapshot

    def reset(self, engine: str) -> None:
        """Forget confirmed hashes (keep optimistic ones) until the next snapshot."""
        entry = self._entry(engine)
        entry.confirmed = set()
        entry.last_sequence = 0
        entry.has_snapshot = False

    def remove_engine(self, engine: str) -> None:
        self._engines.pop(engine, None)

    # ---- routing ----------------------------------------------------------------------

    def insert_optimistic(self, engine: str, hashes: Iterable[int]) -> None:
        """Assume `engine` will hold these blocks soon (it was just sent the prompt)."""
        entry = self._entry(engine)
        expiry = self._clock() + self.optimistic_ttl_s
        for h in hashes:
            if h not in entry.confirmed:
                entry.optimistic[h] = expiry

    def match(self, engine: str, hashes: Sequence[int]) -> int:
        """Number of leading blocks of `hashes` that `engine` holds (confirmed or optimistic).

        Hashes chain over the whole prefix, so the first miss ends the match.
        """
        entry = self._engines.get(engine)
        if entry is None:
            return 0
        now = self._clock()
        matched = 0
        for h in hashes:
            if h in entry.confirmed:
                matched += 1
                continue
            expiry = entry.optimistic.get(h)
            if expiry is None:
                break
            if expiry <= now:
                del entry.optimistic[h]
                break
            matched += 1
        return matched

    def expire(self) -> None:
        """Drop expired optimistic entries of every engine (call now and then)."""
        now = self._clock()
        for entry in self._engines.values():
            dead = [h for h, expiry in entry.optimistic.items() if expiry <= now]
            for h in dead:
                del entry.optimistic[h]
