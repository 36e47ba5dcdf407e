"""The engine core process: owns the engine (LLMEngine, or DiffusionEngine for a diffusion
model: engines.make_engine) and runs the step loop.

The gRPC frontend lives in another process so token streaming never steals the
interpreter from the step loop, and a step never blocks the RPCs. They talk over two one-way
multiprocessing pipes (one reader and one writer on each end, so no locking):

  frontend -> core: AddRequest | AbortRequest | Shutdown
  core -> frontend: CoreReady (once, after the model loaded) | CoreFailed | StepOutputs
                    (per step: request outputs, KV events, load, admissions, speculative-
                    decoding counts) | AddRejected
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from engine_service.block_manager import KvEvent
from engine_service.common.sampling_params import SamplingParams
from engine_service.config import EngineConfig, cpu_threads
from engine_service.engine import LoadSnapshot, RequestOutput
from engine_service.sequence import Sequence, SequenceStatus
from engine_service.spec_decode.speculator import SpecDecodeStats

logger = logging.getLogger(__name__)
IDLE_POLL_SECONDS = 0.5
# A step with nothing to report (a prefill chunk) still sends this often: the frontend's
# watchdog counts any message as progress and would otherwise take a long prefill for a hang.
HEARTBEAT_SECONDS = 0.25


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # lower runs earlier under --scheduling-policy priority


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    pass


@dataclass
class CoreReady:
    model_info: dict
    cached_block_hashes: list[int]
    load: LoadSnapshot
    # K when the engine speculates (None: off), so the frontend creates the per-position
    # series up front, as vLLM does, rather than at the first draft.
    num_speculative_tokens: int | None = None


@dataclass
class CoreFailed:
    error: str


@dataclass
class AddRejected:
    request_id: str
    error: str


@dataclass
class Admitted:
    """A request's first schedule: what vLLM's queue-time and prefix-cache metrics count."""
    queue_seconds: float
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass
class StepOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    kv_events: list[KvEvent] = field(default_factory=list)
    load: LoadSnapshot = field(default_factory=LoadSnapshot)
    aborted: list[str] = field(default_factory=list)
    admitted: list[Admitted] = field(default_factory=list)
    spec_decode: SpecDecodeStats | None = None  # counts of this step's verify rows, if any


def run_core(config: EngineConfig, requests: Connection, outputs: Connection) -> None:
    """Entry point of the core process."""
    # The frontend decides when to stop (SIGTERM drains there); the core follows the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("NANOSERVE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s core %(levelname)s %(name)s: %(message)s")
    try:
        import torch

        from engine_service.engines import make_engine

        # Several engines (or tensor-parallel ranks) may share the host: take our share of
        # the cores, never all of them, or their thread pools fight over every core.
        torch.set_num_threads(cpu_threads(config.tensor_parallel_size))
        logger.info("torch threads: %d", torch.get_num_threads())
        engine = make_engine(config)
    except Exception:
        outputs.send(CoreFailed(traceback.format_exc()))
        return
    k = engine.speculator.k if engine.speculator is not None else None
    outputs.send(CoreReady(engine.model_info(), engine.cached_block_hashes(),
                           engine.load_snapshot(), k))
    try:
        _loop(engine, requests, outputs)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the frontend went away: nothing left to serve
    except Exception:
        logger.exception("engine core failed")
        with contextlib.suppress(OSError):
            outputs.send(CoreFailed(traceback.format_exc()))
    finally:
        engine.shutdown()


def _take_admitted(queued: dict[str, tuple[Sequence, float]],
                   scheduled_at: float) -> list[Admitted]:
    """Pop the sequences of `queued` (id -> sequence, time added) that left the waiting
    queue (the step may also have finished them)."""
    admitted = []
    for rid, (seq, added) in list(queued.items()):
        if seq.status is not SequenceStatus.WAITING:
            del queued[rid]
            admitted.append(Admitted(scheduled_at - added, seq.num_prompt_tokens,
                                     seq.num_cached_tokens))
    return admitted


def _take_spec_stats(engine) -> SpecDecodeStats | None:
    """The speculator's counts since the last call; None when it verified no draft since
    (speculation off, or no row had proposals), so such a message carries nothing more."""
    speculator = engine.speculator
    if speculator is None or not speculator.stats.num_drafts:
        return None
    return speculator.take_stats()


def _loop(engine, requests: Connection, outputs: Connection) -> None:
    last_sent = time.monotonic()
    queued: dict[str, tuple[Sequence, float]] = {}  # not yet scheduled, and when added
    while True:
        engine.check_alive()  # a dead tensor-parallel rank fails even when idle
        # Block only when there is nothing to step; otherwise just drain what arrived.
        timeout = 0 if engine.has_unfinished() else IDLE_POLL_SECONDS
        aborted: list[str] = []
        changed = False
        while requests.poll(timeout):
            msg = requests.recv()
            timeout = 0
            changed = True
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AbortRequest):
                queued.pop(msg.request_id, None)
                if engine.abort(msg.request_id):
                    aborted.append(msg.request_id)
            elif isinstance(msg, AddRequest):
                try:
                    seq = engine.add_request(msg.request_id, msg.prompt_token_ids,
                                             msg.sampling_params, msg.priority)
                    queued[msg.request_id] = (seq, time.monotonic())
                except ValueError as e:
                    outputs.send(AddRejected(msg.request_id, str(e)))
        stepped = engine.has_unfinished()
        scheduled_at = time.monotonic()
        step_outputs = engine.step() if stepped else []
        admitted = _take_admitted(queued, scheduled_at) if queued else []
        events = engine.take_kv_events()
        spec = _take_spec_stats(engine)
        now = time.monotonic()
        if step_outputs or events or aborted or changed or admitted or spec is not None or (
                stepped and now - last_sent >= HEARTBEAT_SECONDS):
            outputs.send(StepOutputs(step_outputs, events, engine.load_snapshot(), aborted,
                                     admitted, spec))
            last_sent = now
