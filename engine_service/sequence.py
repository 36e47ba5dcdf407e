"""One request inside the engine: its tokens, how far its KV is computed, and its blocks."""

from __future__ import annotations

import random
from enum import Enum, auto
from typing import TYPE_CHECKING

from engine_service.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine_service.structured_output import TokenConstraint


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


# `SequenceStatus.FINISHED` is a ~70 ns lookup on Python 3.11; is_finished runs per row per step.
_FINISHED = SequenceStatus.FINISHED


class Sequence:
    """A prompt and its outputs in one token list; the scheduler and block manager mutate it.

    `num_cached_tokens`: prompt tokens the prefix cache served at the *first* schedule (what
    usage reports; recomputes after preemption do not change it). `arrival`: FCFS order, set
    by `Scheduler.add`, as is `sched_key`, the scheduler's order: (priority, arrival) under
    the priority policy, (0, arrival) under fcfs; lower runs earlier. `num_pending_tokens`
    (0 or 1): a token sampled on the device but not yet in `token_ids` (async scheduling);
    its KV slot is scheduled like any other token.
    """

    __slots__ = (
        "seq_id", "token_ids", "num_prompt_tokens", "num_computed_tokens", "num_cached_tokens",
        "block_table", "block_hashes", "num_hashed_blocks", "status", "sampling_params", "seed",
        "arrival", "num_pending_tokens", "finish_reason", "stop_reason", "num_preemptions",
        "priority", "sched_key", "constraint", "draft_kv",
    )

    def __init__(self, seq_id: str, token_ids: list[int], sampling_params: SamplingParams,
                 arrival: int = 0, priority: int = 0) -> None:
        if len(token_ids) == 0:
            raise ValueError(f"prompt of {seq_id!r} must have at least one token")
        self.seq_id = seq_id
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # memo of full blocks' hashes; survives preemption
        # Leading blocks of block_table that cache_full_blocks has already dealt with.
        self.num_hashed_blocks = 0
        self.status = SequenceStatus.WAITING
        self.sampling_params = sampling_params
        # Module-level random so `random.seed(...)` at engine start makes unseeded runs repeat.
        self.seed: int = (sampling_params.seed if sampling_params.seed is not None
                          else random.getrandbits(63))
        self.arrival = arrival
        self.priority = priority
        self.sched_key: tuple[int, int] = (0, arrival)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # Structured output / allowed_token_ids; set by the engine once compiled.
        self.constraint: TokenConstraint | None = None
        self.num_preemptions = 0
        # Speculative decoding's draft model: (num_preemptions when written, tokens its KV
        # covers, the proposals it was fed after them); see spec_decode/draft_proposer.py.
        self.draft_kv: tuple[int, int, list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens on the host (pending ones not counted)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, pending={self.num_pending_tokens}, "
                f"blocks={self.block_table})")
