"""Continuous batching: one mixed batch of decode rows and prefill chunks per step."""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Sequence as SequenceT
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

from engine_service.block_manager import BlockManager
from engine_service.config import EngineConfig
from engine_service.sequence import Sequence, SequenceStatus

_KEY = attrgetter("sched_key")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # computed this step: positions start .. start + num_new_tokens - 1
    sample: bool  # the chunk reaches the sequence's last token, so a new token is sampled
    start: int  # KV tokens computed before this step
    # A verify row: tokens proposed after the last one, the last num_new_tokens - 1 inputs.
    # Every position samples; the target's token at each is kept while it matches.
    spec_token_ids: SequenceT[int] = ()

    def __post_init__(self) -> None:
        if self.num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {self.num_new_tokens}")
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")

    @property
    def is_decode(self) -> bool:
        return (self.num_new_tokens - len(self.spec_token_ids) == 1
                and self.start >= self.seq.num_prompt_tokens)

    @property
    def output_index(self) -> int:
        """Index among the sequence's outputs of the (first) token this row samples."""
        return (self.start + self.num_new_tokens - len(self.spec_token_ids)
                - self.seq.num_prompt_tokens)

    @property
    def num_samples(self) -> int:
        """Tokens this row draws: one per verified position, else 1 or 0."""
        return len(self.spec_token_ids) + 1 if self.sample else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]  # decode rows first, then prefill chunks
    num_batched_tokens: int
    preempted: list[Sequence]
    num_prefill_tokens: int = 0  # of num_batched_tokens, those of rows that are not is_decode
    num_spec_tokens: int = 0  # proposed tokens the rows carry

    @property
    def is_speculative(self) -> bool:
        return self.num_spec_tokens > 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Proposer(Protocol):
    """Speculative decoding's proposals, for decode rows whose last token is on the host."""

    def limits(self, seqs: list[Sequence]) -> list[int]:
        """How many tokens each sequence may be proposed (0: none)."""
        ...

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        """At most limits[i] tokens for seqs[i]; KV slots for them are allocated."""
        ...


class Scheduler:
    """Sequences run in `sched_key` order, (priority, arrival) under the priority policy and
    (0, arrival) under fcfs: lower first. Under KV pressure the running one with the worst key
    is preempted and later recomputed; a waiting head with a better key than a running one
    preempts it when it cannot be admitted otherwise. `schedule()` commits the step as
    launched (KV computed, a pending token per sampling row), so the next step can be
    scheduled before its tokens reach the host; `postprocess()` then appends them."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager,
                 eos_token_ids: list[int]) -> None:
        if block_manager.block_size != config.kv_block_size:
            raise ValueError(f"block manager block_size {block_manager.block_size} != "
                             f"kv_block_size {config.kv_block_size}")
        if block_manager.num_blocks < config.max_blocks_per_seq:
            # Otherwise a lone sequence of max_model_len tokens could never finish.
            raise ValueError(f"{block_manager.num_blocks} KV blocks cannot hold one sequence "
                             f"of max_model_len={config.max_model_len} tokens")
        self.config = config
        self.block_manager = block_manager
        self.max_model_len: int = config.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()  # both kept sorted by sched_key
        self.running: list[Sequence] = []
        self._unfinished: dict[str, Sequence] = {}
        self._arrivals = itertools.count()
        self._by_priority = config.scheduling_policy == "priority"

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def get(self, seq_id: str) -> Sequence | None:
        """The unfinished sequence with this id, if any."""
        return self._unfinished.get(seq_id)

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._unfinished:
            raise ValueError(f"request id {seq.seq_id!r} is already in the engine")
        if seq.num_prompt_tokens > self.max_model_len:
            raise ValueError(f"prompt has {seq.num_prompt_tokens} tokens, more than "
                             f"max_model_len={self.max_model_len}")
        seq.status = SequenceStatus.WAITING
        seq.arrival = next(self._arrivals)
        seq.sched_key = (seq.priority if self._by_priority else 0, seq.arrival)
        self._unfinished[seq.seq_id] = seq
        bisect.insort(self.waiting, seq, key=_KEY)

    def abort(self, seq_id: str) -> Sequence | None:
        seq = self._unfinished.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return seq

    def tokens_in_flight(self) -> int:
        """Prompt tokens not yet computed + tokens still to generate, over unfinished seqs."""
        # Asked after every step: attributes and comparisons, not properties and min()/max().
        total, max_len = 0, self.max_model_len
        for seq in self._unfinished.values():
            num_tokens, num_prompt = len(seq.token_ids), seq.num_prompt_tokens
            prompt_left = num_prompt - seq.num_computed_tokens
            to_generate = seq.sampling_params.max_tokens - (num_tokens - num_prompt)
            if max_len - num_tokens < to_generate:
                to_generate = max_len - num_tokens
            if prompt_left > 0:
                total += prompt_left
            if to_generate > 0:
                total += to_generate
        return total

    def schedule(self, proposer: Proposer | None = None) -> SchedulerOutput:
        """One step's batch. With a `proposer` (speculative decoding) a decode row reserves
        KV slots and budget for as many proposed tokens as it may take, and once the batch
        is settled carries those it was proposed (a draft model writes its KV there)."""
        bm = self.block_manager
        block_size = bm.block_size
        budget = self.config.max_num_batched_tokens
        rows: dict[str, ScheduledSeq] = {}  # insertion order = batch order
        preempted: list[Sequence] = []

        # Running sequences: decode rows first, then prefill chunks, each by key. A
        # chunk shrinks to the free blocks; only a sequence that cannot take one token
        # preempts. Hot loop: attributes, not Sequence's properties.
        decode, prefill = self._split_running()
        limits = dict(zip(map(id, decode), proposer.limits(decode), strict=True)) \
            if proposer is not None and decode else {}
        status_running = SequenceStatus.RUNNING  # hoisted: an Enum member lookup per row
        for seq in itertools.chain(decode, prefill):
            if budget == 0:
                break
            if seq.status is not status_running:
                continue  # preempted earlier in this loop
            computed = seq.num_computed_tokens
            total = len(seq.token_ids) + seq.num_pending_tokens
            want = total - computed  # min(budget) without the builtin call
            if want > budget:
                want = budget
            limit = limits.get(id(seq))
            if limit:
                budget = self._schedule_verify(seq, limit, rows, preempted, budget)
                continue
            if want == 1 and computed < len(seq.block_table) * block_size:
                # Its last block has room: no allocation.
                rows[seq.seq_id] = ScheduledSeq(seq, 1, computed + 1 == total, computed)
                budget -= 1
                continue
            while True:
                num_new = min(want, self._num_fitting_tokens(seq))
                if num_new > 0:
                    bm.allocate(seq, num_new)
                    rows[seq.seq_id] = self._row(seq, num_new)
                    budget -= num_new
                    break
                victim = self._preempt_worst(preempted)
                if victim.seq_id in rows:
                    budget += rows.pop(victim.seq_id).num_new_tokens
                if victim is seq:
                    break
        budget = self._admit_waiting(rows, preempted, budget)
        if limits:
            self._take_proposals(rows, proposer)

        scheduled = list(rows.values())
        num_prefill = num_spec = num_batched = 0
        for row in scheduled:
            num_batched += row.num_new_tokens
            seq = row.seq
            if row.spec_token_ids:
                num_spec += len(row.spec_token_ids)
            elif row.num_new_tokens != 1 or row.start < seq.num_prompt_tokens:  # not is_decode
                num_prefill += row.num_new_tokens
            seq.num_computed_tokens += row.num_new_tokens
            seq.num_pending_tokens += row.sample
        return SchedulerOutput(scheduled, num_batched, preempted, num_prefill, num_spec)

    def _schedule_verify(self, seq: Sequence, limit: int, rows: dict[str, ScheduledSeq],
                         preempted: list[Sequence], budget: int) -> int:
        """A decode row that may take proposals: its last token plus up to `limit` more, as
        many as the budget and the free blocks hold (preempting only if not even the last
        token fits). Returns the budget left."""
        while True:
            fitting = min(budget, self._num_fitting_tokens(seq), 1 + limit)
            if fitting > 0:
                self.block_manager.allocate(seq, 1, num_lookahead_tokens=fitting - 1)
                # Placeholder proposals: _take_proposals puts the real ones in.
                rows[seq.seq_id] = ScheduledSeq(seq, fitting, True, seq.num_computed_tokens,
                                                [0] * (fitting - 1))
                return budget - fitting
            victim = self._preempt_worst(preempted)
            if victim.seq_id in rows:
                budget += rows.pop(victim.seq_id).num_new_tokens
            if victim is seq:
                return budget

    @staticmethod
    def _take_proposals(rows: dict[str, ScheduledSeq], proposer: Proposer) -> None:
        """Fill the reserved rows with their proposals; a row proposed fewer tokens than
        it reserved computes fewer (its spare blocks go back when the step lands)."""
        reserved = [row for row in rows.values() if row.spec_token_ids]
        if not reserved:
            return
        proposals = proposer.propose([row.seq for row in reserved],
                                     [len(row.spec_token_ids) for row in reserved])
        for row, spec in zip(reserved, proposals, strict=True):
            row.spec_token_ids = spec
            row.num_new_tokens = 1 + len(spec)

    def _admit_waiting(self, rows: dict[str, ScheduledSeq], preempted: list[Sequence],
                       budget: int) -> int:
        """Admit waiting sequences strictly in key order (a head that is skipped would starve
        behind smaller requests); returns the budget left. A head more urgent than the worst
        running sequence preempts running ones, worst first, while it does not fit (never
        under fcfs, where every waiting sequence arrived after every running one). After a
        preemption memory is short: only such a head goes on, or the one that made room."""
        bm, running, max_seqs = self.block_manager, self.running, self.config.max_num_seqs
        made_room_for = None
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.num_pending_tokens:
                break  # preempted with its last token in flight: admit once it has landed
            urgent = bool(running) and seq.sched_key < running[-1].sched_key
            if preempted and not urgent and seq is not made_room_for:
                break
            num_new = min(seq.num_tokens - bm.get_num_cached_tokens(seq), budget)
            if len(running) < max_seqs and bm.can_allocate(seq, num_new):
                self.waiting.popleft()
                bm.allocate(seq, num_new)
                seq.status = SequenceStatus.RUNNING
                bisect.insort(running, seq, key=_KEY)
                rows[seq.seq_id] = self._row(seq, num_new)
                budget -= num_new
            elif urgent:
                made_room_for = seq
                victim = self._preempt_worst(preempted)
                if victim.seq_id in rows:
                    budget += rows.pop(victim.seq_id).num_new_tokens
            else:
                break
        return budget

    def _split_running(self) -> tuple[list[Sequence], list[Sequence]]:
        """(decode, prefill): running sequences with one token left to compute, and with
        more, in key order. A decode whose pending token surely ends it by length is left
        out: that token would be waste, and past max_model_len it has no KV slot."""
        decode: list[Sequence] = []
        prefill: list[Sequence] = []
        max_len = self.max_model_len
        for seq in self.running:
            pending = seq.num_pending_tokens
            total = len(seq.token_ids) + pending  # tokens, the pending one included
            left = total - seq.num_computed_tokens
            if left > 1:
                prefill.append(seq)
            elif left == 1 and not (pending and (
                    total - seq.num_prompt_tokens >= seq.sampling_params.max_tokens
                    or total >= max_len)):
                decode.append(seq)
        return decode, prefill

    def _num_fitting_tokens(self, seq: Sequence) -> int:
        """New tokens a running seq could compute with its blocks plus the free ones."""
        bm = self.block_manager
        capacity = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size
        return capacity - seq.num_computed_tokens

    def _row(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        end = seq.num_computed_tokens + num_new
        return ScheduledSeq(seq, num_new, end == seq.num_tokens + seq.num_pending_tokens,
                            seq.num_computed_tokens)

    def _preempt_worst(self, preempted: list[Sequence]) -> Sequence:
        victim = self.running.pop()
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        bisect.insort(self.waiting, victim, key=_KEY)
        preempted.append(victim)
        return victim

    def postprocess(self, output: SchedulerOutput, sampled_token_ids: list[int | None],
                    accepted: list[list[int]] | None = None) -> list[Sequence]:
        """Advance the scheduled sequences by one step; return (and free) those finished.
        A speculative step also gives each row's `accepted` tokens (its first is the row's
        sampled token); a row that stops early has its list cut to the tokens it took."""
        if len(sampled_token_ids) != len(output.scheduled):
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for "
                             f"{len(output.scheduled)} scheduled rows")
        for row, token_id in zip(output.scheduled, sampled_token_ids, strict=True):
            if row.sample != (token_id is not None):
                raise ValueError(f"row {row.seq.seq_id!r}: sample={row.sample} but got "
                                 f"token {token_id!r}")
        if output.is_speculative and accepted is None:
            raise ValueError("a speculative step needs each row's accepted tokens")
        bm = self.block_manager
        finished: list[Sequence] = []
        status_finished = SequenceStatus.FINISHED  # hot loop: hoisted, and no properties
        for r, (row, token_id) in enumerate(zip(output.scheduled, sampled_token_ids,
                                                strict=True)):
            seq = row.seq
            if seq.status is status_finished:
                continue  # aborted, or stopped by its previous token, while the step ran
            if row.spec_token_ids:
                assert accepted is not None
                stopped = self._land_verified(row, accepted[r])
            else:
                if token_id is not None:
                    seq.num_pending_tokens -= 1
                    seq.token_ids.append(token_id)
                bm.cache_full_blocks(seq)  # returns at once unless a block filled up
                stopped = token_id is not None and self._check_stop(seq, token_id)
            if stopped:
                seq.status = status_finished
                bm.free(seq)
                del self._unfinished[seq.seq_id]
                finished.append(seq)
        if finished:
            self.running = [s for s in self.running if not s.is_finished]
            # A sequence preempted while its last token was in flight waits re-admission.
            if any(s.is_finished for s in self.waiting):
                self.waiting = deque(s for s in self.waiting if not s.is_finished)
        return finished

    def _land_verified(self, row: ScheduledSeq, tokens: list[int]) -> bool:
        """Append a verify row's tokens up to a stop (cutting `tokens` there); the KV of
        its rejected proposals is void, and blocks taken only for them go back. Returns
        whether the sequence stopped."""
        seq = row.seq
        seq.num_pending_tokens -= 1
        seq.num_computed_tokens -= len(row.spec_token_ids) - (len(tokens) - 1)
        self.block_manager.rollback(seq)
        stopped = False
        for n, token_id in enumerate(tokens, 1):
            seq.token_ids.append(token_id)
            if self._check_stop(seq, token_id):
                del tokens[n:]
                stopped = True
                break
        self.block_manager.cache_full_blocks(seq)
        return stopped

    def _check_stop(self, seq: Sequence, token_id: int) -> bool:
        """Set finish_reason/stop_reason if seq must stop after its last token, token_id."""
        params = seq.sampling_params
        num_tokens = len(seq.token_ids)
        num_outputs = num_tokens - seq.num_prompt_tokens
        if num_outputs >= params.min_tokens:
            if token_id in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token_id
                return True
            if not params.ignore_eos and token_id in self.eos_token_ids:
                seq.finish_reason = "stop"
                return True
        if num_outputs >= params.max_tokens or num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False
