"""The engine's side of speculative decoding: when a step speculates, how many tokens each
decode row may carry, the proposer that fills them, and acceptance counts for metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine_service.config import EngineConfig
from engine_service.scheduler import SchedulerOutput
from engine_service.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]: ...

    def may_propose(self, seqs: list[Sequence]) -> bool: ...


@dataclass
class SpecDecodeStats:
    """Counts since the last take(), under vLLM's spec_decode names."""

    num_drafts: int = 0  # verify rows
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposed tokens the target kept
    accepted_per_pos: list[int] = field(default_factory=list)  # [K]: kept at position i


class Speculator:
    def __init__(self, config: EngineConfig, proposer: Proposer) -> None:
        assert config.num_speculative_tokens is not None
        self.k = config.num_speculative_tokens
        self.max_batch_size = config.speculative_disable_by_batch_size
        self.max_model_len = config.max_model_len
        self.proposer = proposer
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)

    def active(self, num_running: int) -> bool:
        """Whether a step with this many running requests speculates: only small batches,
        where decoding is memory-bound and verifying K more tokens per row is nearly free."""
        return num_running <= self.max_batch_size

    def limits(self, seqs: list[Sequence]) -> list[int]:
        """How many tokens each decode row may be proposed: none without its last token on
        the host, or with a grammar (whose matcher checks one token a step); never past
        max_tokens or max_model_len (the target adds one token of its own)."""
        limits = []
        for seq in seqs:
            k = 0
            if not seq.num_pending_tokens and seq.constraint is None:
                outputs_left = seq.sampling_params.max_tokens - seq.num_output_tokens
                k = max(0, min(self.k, outputs_left - 1,
                               self.max_model_len - seq.num_tokens - 1))
            limits.append(k)
        return limits

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[list[int]]:
        return self.proposer.propose(seqs, limits)

    def may_propose(self, seqs: list[Sequence]) -> bool:
        """Whether proposals are likely for these running sequences, judged from the tokens
        on the host (one step old while a step is in flight): worth landing that step for,
        since a speculative step cannot overlap it."""
        return self.proposer.may_propose([seq for seq in seqs if seq.constraint is None])

    def record(self, sched: SchedulerOutput, accepted: list[list[int]]) -> None:
        """Count one verify step from each row's tokens before a stop cut them: a row kept
        all but the last of them from its proposals."""
        stats = self.stats
        for row, tokens in zip(sched.scheduled, accepted, strict=True):
            if not row.spec_token_ids:
                continue
            stats.num_drafts += 1
            stats.num_draft_tokens += len(row.spec_token_ids)
            stats.num_accepted_tokens += len(tokens) - 1
            for i in range(len(tokens) - 1):
                stats.accepted_per_pos[i] += 1

    def take_stats(self) -> SpecDecodeStats:
        stats, self.stats = self.stats, SpecDecodeStats(accepted_per_pos=[0] * self.k)
        return stats


def make_speculator(config: EngineConfig, runner) -> Speculator | None:
    """The configured speculator (None: speculation off); a draft model is the runner's,
    built with the target since its KV cache shares the target's blocks."""
    if config.speculative_method is None:
        return None
    if config.speculative_method == "ngram":
        from engine_service.spec_decode.ngram_proposer import NgramProposer

        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        return Speculator(config, NgramProposer(config.prompt_lookup_min,
                                                config.prompt_lookup_max))
    return Speculator(config, runner.drafter)
