"""LLMEngine: the step loop (add_request / abort / step) shared by the offline `LLM` and the
core process. Requests are token ids: (de)tokenization belongs to the caller."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence as SequenceT
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_service.block_manager import BlockManager, KvEvent
from engine_service.common.block_hash import HASH_SCHEME
from engine_service.common.sampling_params import (
    SamplingParams,
    check_diffusion_request,
    validate_prompt,
    validate_token_controls,
)
from engine_service.config import EngineConfig
from engine_service.scheduler import Scheduler, SchedulerOutput
from engine_service.sequence import Sequence
from engine_service.spec_decode.speculator import make_speculator

if TYPE_CHECKING:
    import torch

    from engine_service.model_runner import LaunchedStep, ModelRunner, StepResult
    from engine_service.scheduler import ScheduledSeq
    from engine_service.structured_output import TokenConstraint

logger = logging.getLogger(__name__)
COMPILE_POLL_SECONDS = 0.005


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: the tokens it added, and on the last
    output of a request its finish reason and token counts."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[float, list[int], list[float]] | None] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    num_forward_passes: int = 0  # diffusion engines: passes the request has taken


@dataclass
class StepStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    seconds: float = 0.0  # the whole call
    wait_seconds: float = 0.0  # of which the host waited for the device's tokens
    device_seconds: float = 0.0  # of the steps read back in the call (CUDA only)
    num_steps: int = 1
    # Of the steps read back, speculative ones (verify rows) and their device time.
    num_verify_steps: int = 0
    verify_device_seconds: float = 0.0

    def add(self, other: StepStats) -> None:
        self.num_prefill_tokens += other.num_prefill_tokens
        self.num_decode_tokens += other.num_decode_tokens
        self.seconds += other.seconds
        self.wait_seconds += other.wait_seconds
        self.device_seconds += other.device_seconds
        self.num_steps += other.num_steps
        self.num_verify_steps += other.num_verify_steps
        self.verify_device_seconds += other.verify_device_seconds


@dataclass
class LoadSnapshot:
    """An engine's load after a step, as GetLoad reports it."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tokens_in_flight: int = 0


class EngineServing:
    """What the core process asks of any engine besides add_request / abort / step (the
    model, its KV blocks and events, a dead tensor-parallel rank); each engine adds its own
    load_snapshot() and a `speculator` (None when it never speculates)."""

    config: EngineConfig
    model_runner: ModelRunner
    block_manager: BlockManager
    vocab_size: int
    eos_token_ids: list[int]

    def check_alive(self) -> None:
        self.model_runner.check_alive()

    def take_kv_events(self) -> list[KvEvent]:
        return self.block_manager.take_events()

    def cached_block_hashes(self) -> list[int]:
        return self.block_manager.cached_block_hashes()

    def model_info(self) -> dict:
        mc = self.model_runner.model_config
        return dict(architecture=mc.architecture, is_diffusion=mc.is_diffusion,
                    max_model_len=self.config.max_model_len,
                    kv_block_size=self.config.kv_block_size, hash_scheme=HASH_SCHEME,
                    vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids,
                    tensor_parallel_size=self.config.tensor_parallel_size,
                    num_kv_blocks=self.block_manager.num_blocks)


class LLMEngine(EngineServing):
    def __init__(self, config: EngineConfig):
        # Torch and xgrammar load here, not on import: the frontend imports this module.
        from engine_service.model_runner import ModelRunner
        from engine_service.structured_output import StructuredOutput

        self.config = config
        from models.config import ModelConfig

        mc = ModelConfig.from_dir(config.model)
        if mc.is_diffusion:  # refused before any weight loads
            raise ValueError(f"{mc.architecture} is a diffusion model: "
                             f"engines.make_engine gives it a DiffusionEngine")
        self.model_runner = ModelRunner(config)
        mc = self.model_runner.model_config
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = list(mc.eos_token_id)
        self.block_manager = BlockManager(self.model_runner.num_kv_blocks, config.kv_block_size)
        self.scheduler = Scheduler(config, self.block_manager, self.eos_token_ids)
        self.last_stats = StepStats()
        self.total_stats = StepStats(num_steps=0)  # since start; benchmarks reset it
        self._async = config.async_scheduling
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None
        self.speculator = make_speculator(config, self.model_runner)
        self.structured = StructuredOutput(config.model, self.vocab_size, self.eos_token_ids,
                                           pin_memory=self.model_runner.device.type == "cuda")
        # Requests whose constraint is compiling; they join the scheduler once it is built.
        self._compiling: dict[str, tuple[Sequence, Future[TokenConstraint]]] = {}
        # What one step() call has read back so far (a mask may land the step in flight).
        self._outputs: list[RequestOutput] = []
        self._read_back: list[LaunchedStep] = []
        # Start-up leaves ~10^5 long-lived objects: frozen, a full collection no longer
        # stalls a step for ~0.1 s.
        gc.collect()
        gc.freeze()

    def add_request(self, request_id: str, prompt_token_ids: SequenceT[int],
                    sampling_params: SamplingParams, priority: int = 0) -> Sequence:
        check_diffusion_request(sampling_params, diffusion_engine=False)
        validate_prompt(prompt_token_ids, self.config.max_model_len, self.vocab_size)
        validate_token_controls(sampling_params, self.vocab_size)
        grammar = self.structured.check(sampling_params)
        if self.scheduler.get(request_id) is not None or request_id in self._compiling:
            raise ValueError(f"request_id must be unique among requests in flight, "
                             f"got duplicate {request_id!r}")
        seq = Sequence(request_id, list(prompt_token_ids), sampling_params, priority=priority)
        if sampling_params.constraint is not None or sampling_params.allowed_token_ids:
            future = self.structured.submit(sampling_params, grammar)
            self._compiling[request_id] = (seq, future)
        else:
            self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            compiling[1].cancel()
            return True
        return self.scheduler.abort(request_id) is not None

    def shutdown(self) -> None:
        self._in_flight = None
        self.structured.shutdown()
        self.model_runner.shutdown()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def _admit_compiled(self) -> None:
        """Requests whose constraint is built join the scheduler (in arrival order). With
        nothing else to run, wait a moment for one rather than spin against the compiler."""
        if not self.scheduler.has_unfinished():
            wait([f for _, f in self._compiling.values()], COMPILE_POLL_SECONDS,
                 FIRST_COMPLETED)
        for request_id, (seq, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                seq.constraint = future.result()
            except Exception as e:  # check() passed it, so this is the compiler's failure
                logger.error("request %r: its constraint failed to compile: %s", request_id, e)
                self._outputs.append(RequestOutput(request_id, [], finished=True,
                                                   finish_reason="abort"))
                continue
            self.scheduler.add(seq)

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step; return the outputs of the step that finished. With
        async scheduling a step finishes during the next call, so the host's work overlaps
        the forward pass (unless a penalty needs a pending token on the host)."""
        t0 = time.perf_counter()
        self._outputs, self._read_back = [], []
        speculate = self.speculator is not None and \
            self.speculator.active(self.scheduler.num_running)
        # Proposals need each row's last token on the host, and a verify step's accepted
        # count decides the next step's positions: neither overlaps the step in flight. While
        # no proposal is likely, the next step overlaps it instead, without proposals.
        if self._in_flight is not None and (not self._can_overlap() or (
                speculate and self.speculator.may_propose(self.scheduler.running))):
            self._land_in_flight()
        if self._compiling:
            self._admit_compiled()
        sched = self.scheduler.schedule(self.speculator if speculate else None)
        launched = None
        if not sched.is_empty:
            if self._async:
                launched = (sched, self.model_runner.launch(
                    sched.scheduled, self.eos_token_ids, self._token_masks))
            else:  # --no-async-scheduling
                done = self.model_runner.execute(sched.scheduled, self.eos_token_ids,
                                                 self._token_masks)
                self._outputs += self._postprocess(sched, done.result())
                self._read_back.append(done)
        if self._in_flight is not None:
            self._land_in_flight()
        self._in_flight = launched
        if not sched.is_empty:
            prefill = sched.num_prefill_tokens
            verify = [f for f in self._read_back if f.is_speculative]
            self.last_stats = StepStats(prefill, sched.num_batched_tokens - prefill,
                                        time.perf_counter() - t0,
                                        sum(f.wait_seconds for f in self._read_back),
                                        sum(f.device_seconds for f in self._read_back), 1,
                                        len(verify), sum(f.device_seconds for f in verify))
            self.total_stats.add(self.last_stats)
        return self._outputs

    def _land_in_flight(self) -> None:
        assert self._in_flight is not None
        sched, launched = self._in_flight
        self._in_flight = None
        self._outputs += self._postprocess(sched, launched.result())
        self._read_back.append(launched)

    def _token_masks(self, rows: list[ScheduledSeq]) -> torch.Tensor:
        """A step's bitmask, asked for once its forward pass is queued: the step in flight
        lands first, since its tokens advance the matchers."""
        if self._in_flight is not None:
            self._land_in_flight()
        return self.structured.fill_bitmask(rows)

    def _can_overlap(self) -> bool:
        """A penalty reads a row's whole output history, pending token included; a verify
        step's rows learn only on the host how many tokens they took."""
        assert self._in_flight is not None
        return not self._in_flight[0].is_speculative and not any(
            s.num_pending_tokens and s.sampling_params.uses_penalties
            for s in self.scheduler.running)

    def _postprocess(self, sched: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Each row's new tokens into its request's output: one token a row, or under
        speculation every token the row kept (cut at a stop by the scheduler)."""
        tokens, logprobs = result.accepted, result.accepted_logprobs
        if tokens is not None:
            assert self.speculator is not None
            self.speculator.record(sched, tokens)
        finished = {s.seq_id for s in self.scheduler.postprocess(sched, result.token_ids,
                                                                 tokens)}
        if tokens is None or logprobs is None:
            tokens = [[] if t is None else [t] for t in result.token_ids]
            logprobs = [[] if t is None else [lp]
                        for t, lp in zip(result.token_ids, result.logprobs, strict=True)]
        outputs = []
        constrained: list[tuple[Sequence, int, RequestOutput]] = []
        for item, new, lps in zip(sched.scheduled, tokens, logprobs, strict=True):
            seq = item.seq
            done = seq.seq_id in finished
            if not done and (not new or seq.is_finished):
                continue  # a mid-prompt chunk, or a row of an aborted / stopped sequence
            # Positional: this runs for every row of every step.
            out = RequestOutput(seq.seq_id, new, lps[:len(new)], done, seq.finish_reason,
                                seq.stop_reason, seq.num_prompt_tokens, seq.num_cached_tokens,
                                seq.num_output_tokens)
            outputs.append(out)
            # A row with a grammar was proposed nothing, so it has one token.
            if seq.constraint is not None and new:
                constrained.append((seq, new[0], out))
        if constrained:
            self._advance_constraints(constrained)
        return outputs

    def _advance_constraints(self, rows: list[tuple[Sequence, int, RequestOutput]]) -> None:
        """Feed each row's token to its request's matcher (one batched call). A request ends
        now when its grammar is complete (even with ignore_eos) or, never expected, when its
        matcher refused the token."""
        accepted = self.structured.accept([(seq.constraint, token) for seq, token, _ in rows])
        for (seq, token, out), ok in zip(rows, accepted, strict=True):
            assert seq.constraint is not None
            if seq.is_finished or (ok and not seq.constraint.is_terminated):
                continue
            if not ok:
                logger.error("request %r: sampled token %d outside its constraint", seq.seq_id,
                             token)
            self.scheduler.abort(seq.seq_id)  # frees its blocks now
            seq.finish_reason = out.finish_reason = "stop" if ok else "abort"
            out.finished = True

    def load_snapshot(self) -> LoadSnapshot:
        s, bm = self.scheduler, self.block_manager
        return LoadSnapshot(s.num_running, s.num_waiting, bm.num_used_blocks, bm.num_blocks,
                            s.tokens_in_flight())
