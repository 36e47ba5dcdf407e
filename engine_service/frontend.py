"""gRPC frontend of an engine: validation, tokenization, the request registry,
incremental detokenization and stop strings, KV-event fan-out, load reporting.

Runs on one asyncio loop in the server process; a reader thread hands every message of
the core process to the loop, so all registry state is touched from the loop only.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NoReturn

import grpc

from engine_service import core_process as core
from engine_service.common.detokenizer import (
    IncrementalDetokenizer,
    OutputStep,
    apply_output,
    tokenizer_if_present,
)
from engine_service.common.openai_protocol import ModelCard
from engine_service.common.proto_convert import (
    FINISH_REASONS,
    Refused,
    cancel_code,
    check_prompt_bytes,
    logprob_to_proto,
    prompt_ids_from_proto,
    sampling_params_from_request,
    stop_reason_to_str,
    unary_from_stream,
)
from engine_service.common.sampling_params import (
    SamplingParams,
    check_diffusion_request,
    check_field,
    validate_prompt,
)
from engine_service.engine import RequestOutput
from engine_service.metrics import EngineMetrics
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
KV_EVENT_HISTORY = 4096  # batches kept for SubscribeKvEvents resumption
TOKENIZER_PIECE_BYTES = 1 << 20


@dataclass
class RequestState:
    request_id: str  # the client's, echoed in chunks; may be reused once this one ends
    core_id: str  # this submission's identity in the core; never reused
    params: SamplingParams
    num_prompt_tokens: int
    detok: IncrementalDetokenizer | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    last_token_time: float | None = None
    num_output_tokens: int = 0
    done: bool = False


class Frontend(pb_grpc.GenerationServicer, pb_grpc.EngineServicer):
    def __init__(self, *, model_dir: str, engine_id: str, requests: Connection,
                 outputs: Connection, max_in_flight: int, metrics: EngineMetrics,
                 model_name: str | None = None):
        self.model_dir = model_dir
        self.model_name = model_name or Path(model_dir).name  # --served-model-name
        self.engine_id = engine_id
        self.tokenizer = tokenizer_if_present(model_dir)
        self._requests = requests
        self._outputs = outputs
        self.max_in_flight = max_in_flight
        self.metrics = metrics
        # Keyed by core id: an output or abort the core sent for an earlier request can
        # never reach a later one that reuses its client request_id.
        self.registry: dict[str, RequestState] = {}
        self.client_ids_in_flight: set[str] = set()
        self._core_ids = itertools.count()
        self.model_info: dict | None = None
        self.load = core.LoadSnapshot()
        self.accepting = True
        self.stopping = False  # set once the server asked the core to shut down
        self.core_error: str | None = None
        # Watchdog: when the core last sent anything, and the requests it still owes output
        # (finished ones a slow client has yet to read are not owed: the core may idle).
        self.last_core_message = time.monotonic()
        self.owed: set[str] = set()
        self.core_stalled = False  # the core has work but sent nothing for the timeout
        self.ready = asyncio.Event()
        self.core_gone = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        # KV events: a mirror of the engine's cached hashes plus recent batches for resume.
        self.cached_hashes: set[int] = set()
        # Numbers start from this process's start time (µs, exact in JSON doubles too), so
        # a subscriber resuming from a number of an earlier process of this engine is
        # below our history and gets a fresh snapshot rather than our unrelated events.
        self.kv_seq = time.time_ns() // 1000
        self.kv_history: collections.deque[pb.KvEventBatch] = collections.deque(
            maxlen=KV_EVENT_HISTORY)
        self.kv_subscribers: set[asyncio.Queue] = set()
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ core connection

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read_core, name="core-reader", daemon=True).start()

    def _read_core(self) -> None:
        while True:
            try:
                msg = self._outputs.recv()
            except (EOFError, OSError):
                msg = core.CoreFailed("engine core process exited")
            self._loop.call_soon_threadsafe(self._on_core_message, msg)
            if isinstance(msg, core.CoreFailed):
                return

    def _send(self, msg) -> None:
        try:
            self._requests.send(msg)
        except (OSError, ValueError):
            self._on_core_message(core.CoreFailed("engine core process is gone"))

    def _on_core_message(self, msg) -> None:
        self._core_progressed()
        if isinstance(msg, core.StepOutputs):
            self.load = msg.load
            self.metrics.observe_load(msg.load)
            self.metrics.observe_admitted(msg.admitted)
            if msg.spec_decode is not None:
                self.metrics.observe_spec_decode(msg.spec_decode)
            now = time.perf_counter()
            for out in msg.outputs:
                state = self.registry.get(out.request_id)
                if out.finished:
                    self.owed.discard(out.request_id)
                if state is not None:
                    self._observe_tokens(state, out, now)
                    state.queue.put_nowait(out)
            self.owed.difference_update(msg.aborted)
            for rid in msg.aborted:
                state = self.registry.get(rid)
                if state is not None:
                    state.queue.put_nowait(RequestOutput(rid, [], finished=True,
                                                         finish_reason="abort"))
            for event in msg.kv_events:
                self._publish_kv_event(event.kind, event.block_hashes)
        elif isinstance(msg, core.CoreReady):
            self.model_info = msg.model_info
            self.load = msg.load
            if msg.num_speculative_tokens is not None:
                self.metrics.enable_spec_decode(msg.num_speculative_tokens)
            if msg.cached_block_hashes:
                self._publish_kv_event("stored", msg.cached_block_hashes)
            self.ready.set()
        elif isinstance(msg, core.AddRejected):
            self.owed.discard(msg.request_id)
            state = self.registry.get(msg.request_id)
            if state is not None:
                state.queue.put_nowait(msg)
        elif isinstance(msg, core.CoreFailed):
            if self.core_error is None and not self.stopping:
                logger.error("engine core failed: %s", msg.error)
            self.core_error = msg.error
            self.core_gone.set()
            for state in self.registry.values():
                state.queue.put_nowait(msg)

    def _observe_tokens(self, state: RequestState, out: RequestOutput, now: float) -> None:
        """Token metrics as the core's output arrives, not as a slow client reads it."""
        if not out.new_token_ids:
            return
        if state.last_token_time is None:
            self.metrics.ttft.observe(now - state.arrival)
            self.metrics.prompt_tokens.inc(state.num_prompt_tokens)
        else:
            self.metrics.itl.observe((now - state.last_token_time) / len(out.new_token_ids))
        state.last_token_time = now
        self.metrics.generation_tokens.inc(len(out.new_token_ids))

    def _core_progressed(self) -> None:
        now = time.monotonic()
        if self.core_stalled:
            logger.warning("engine core made progress again after %.1f s; serving resumes",
                           now - self.last_core_message)
            self.core_stalled = False
        self.last_core_message = now

    def check_core_progress(self, timeout: float) -> bool:
        """The watchdog's tick: mark the core stalled when it owes output but sent nothing
        for `timeout` seconds; True while it is stalled."""
        silent = time.monotonic() - self.last_core_message
        if not self.core_stalled and self.owed and silent >= timeout \
                and self.core_error is None:
            self.core_stalled = True
            logger.error("engine core has made no progress for %.1f s with %d requests in "
                         "flight; reporting NOT_SERVING until it does", silent, len(self.owed))
        return self.core_stalled

    # ------------------------------------------------------------ KV events

    def _publish_kv_event(self, kind: str, hashes: list[int]) -> None:
        self.kv_seq += 1
        stored = hashes if kind == "stored" else []
        removed = hashes if kind == "removed" else []
        self.cached_hashes.update(stored)
        self.cached_hashes.difference_update(removed)
        batch = pb.KvEventBatch(sequence_number=self.kv_seq, block_hashes_stored=stored,
                                block_hashes_removed=removed,
                                kv_block_size=self._block_size())
        self.kv_history.append(batch)
        for q in self.kv_subscribers:
            q.put_nowait(batch)

    @property
    def is_diffusion(self) -> bool:
        """The engine serves a diffusion model (known once the core is ready)."""
        return bool(self.model_info and self.model_info.get("is_diffusion"))

    def model_card(self) -> ModelCard | None:
        """The model the HTTP front serves; None until the core is ready."""
        info = self.model_info
        return None if info is None else ModelCard(self.model_name, info["max_model_len"],
                                                   info["vocab_size"], self.is_diffusion)

    def _block_size(self) -> int:
        return int(self.model_info["kv_block_size"]) if self.model_info else 0

    def _kv_snapshot(self) -> pb.KvEventBatch:
        return pb.KvEventBatch(sequence_number=self.kv_seq, snapshot=True,
                               block_hashes_stored=sorted(self.cached_hashes),
                               kv_block_size=self._block_size())

    # ------------------------------------------------------------ request intake

    def _refuse(self, code: grpc.StatusCode, message: str) -> NoReturn:
        self.metrics.error(code.name)
        raise Refused(code, message)

    async def _submit(self, request: pb.GenerateRequest) -> RequestState:
        if self.core_error is not None:
            self._refuse(grpc.StatusCode.UNAVAILABLE, "engine core is not running")
        if self.core_stalled:
            silent = time.monotonic() - self.last_core_message
            self._refuse(grpc.StatusCode.UNAVAILABLE,
                         f"engine core has made no progress for {silent:.0f} s")
        if not self.accepting:
            self._refuse(grpc.StatusCode.UNAVAILABLE,
                         "engine is draining and takes no new requests")
        if not self.ready.is_set():
            self._refuse(grpc.StatusCode.UNAVAILABLE, "engine is still loading the model")
        rid = request.request_id or uuid.uuid4().hex
        try:
            params = sampling_params_from_request(request)
            # Here, not in the core: a request for the other kind of engine costs no round trip.
            check_diffusion_request(params, self.is_diffusion)
            if params.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer, which this engine lacks; "
                                 "use stop_token_ids")
            check_prompt_bytes(request, self.model_info["max_model_len"])
            # Tokenizing a long prompt takes a while: off the loop, so other streams flow.
            ids = await asyncio.to_thread(self._prompt_ids, request)
            # Checked after the await, right before registering: no duplicate slips between.
            check_field(rid not in self.client_ids_in_flight, "request_id",
                        "unique among requests in flight", rid)
        except ValueError as e:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if len(self.registry) >= self.max_in_flight:
            self._refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"the engine's queue is full ({self.max_in_flight} requests in "
                         f"flight); retry later")
        detok = None if self.tokenizer is None else IncrementalDetokenizer(
            self.tokenizer, params.skip_special_tokens, params.stop)
        state = RequestState(rid, f"{next(self._core_ids):x}", params, len(ids), detok)
        if not self.owed:  # the core was idle, so its silence until now was no stall
            self.last_core_message = time.monotonic()
        self.owed.add(state.core_id)
        self.registry[state.core_id] = state
        self.client_ids_in_flight.add(rid)
        self.idle.clear()
        self._send(core.AddRequest(state.core_id, ids, params, request.priority))
        return state

    def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        ids = prompt_ids_from_proto(request, self.tokenizer)
        validate_prompt(ids, self.model_info["max_model_len"], self.model_info["vocab_size"])
        return ids

    def _release(self, state: RequestState) -> None:
        if not state.done:  # cancelled, expired, or ended by a stop string: free its blocks
            self._send(core.AbortRequest(state.core_id))
        self.owed.discard(state.core_id)
        if self.registry.pop(state.core_id, None) is not None:
            self.client_ids_in_flight.discard(state.request_id)
        if not self.registry:
            self.idle.set()

    # ------------------------------------------------------------ chunks

    async def _chunks(self, state: RequestState) -> AsyncIterator[pb.GenerateChunk]:
        """One chunk per wake-up, holding every token that arrived since the last one; from a
        diffusion engine, one chunk per output: a block, final, is what its client sees."""
        while not state.done:
            items = [await state.queue.get()]
            while not self.is_diffusion and not state.queue.empty():
                items.append(state.queue.get_nowait())
            chunk = pb.GenerateChunk(request_id=state.request_id, engine_id=self.engine_id)
            for item in items:
                if isinstance(item, core.AddRejected):
                    self._refuse(grpc.StatusCode.INVALID_ARGUMENT, item.error)
                if isinstance(item, core.CoreFailed):
                    self._refuse(grpc.StatusCode.UNAVAILABLE,
                                 "engine core failed while serving the request")
                if self._apply_output(state, item, chunk):
                    break
            if chunk.token_ids or chunk.text or state.done:
                yield chunk

    def _apply_output(self, state: RequestState, out: RequestOutput,
                      chunk: pb.GenerateChunk) -> bool:
        """Add one step's output to the chunk; True when the request has ended."""
        step = apply_output(state.detok, out)
        tokens = out.new_token_ids[:step.num_tokens]
        state.num_output_tokens += len(tokens)
        chunk.token_ids.extend(tokens)
        for token, lp in zip(tokens, out.new_logprobs, strict=False):
            if lp is not None:
                chunk.logprobs.append(logprob_to_proto(token, lp))
        chunk.text += step.text
        if step.finished:
            self._finish(state, chunk, step, out)
        return state.done

    def _finish(self, state: RequestState, chunk: pb.GenerateChunk, step: OutputStep,
                out: RequestOutput) -> None:
        chunk.finish_reason = FINISH_REASONS[step.finish_reason]
        chunk.stop_reason = stop_reason_to_str(step.stop_reason)
        chunk.usage.CopyFrom(pb.Usage(prompt_tokens=state.num_prompt_tokens,
                                      completion_tokens=state.num_output_tokens,
                                      cached_prompt_tokens=out.num_cached_tokens,
                                      num_forward_passes=out.num_forward_passes))
        self.metrics.finished[step.finish_reason or "abort"].inc()
        self.metrics.e2e.observe(time.perf_counter() - state.arrival)
        if step.stopped_by_text and not out.finished:
            self._release(state)  # a stop string: abort in the core now
        state.done = True  # else the core already freed it

    # ------------------------------------------------------------ Generation service

    async def Stream(self, request, context):
        state = await self._submit(request)
        try:
            async for chunk in self._chunks(state):
                yield chunk
        # GeneratorExit: cancelled while grpc was writing a chunk, outside this generator.
        except (asyncio.CancelledError, GeneratorExit):
            if not state.done:  # else it finished; only its last chunk's write was cut
                self.metrics.error(cancel_code(context))
                self.metrics.finished["abort"].inc()
            raise
        finally:
            self._release(state)

    async def Generate(self, request, context):
        return await unary_from_stream(self.Stream(request, context))

    # ------------------------------------------------------------ Engine service

    async def GetModelInfo(self, request, context):
        self._wait_ready()
        info = self.model_info
        return pb.ModelInfo(model_name=self.model_name, engine_id=self.engine_id,
                            architecture=info["architecture"],
                            max_model_len=info["max_model_len"],
                            kv_block_size=info["kv_block_size"],
                            hash_scheme=info["hash_scheme"], vocab_size=info["vocab_size"],
                            eos_token_ids=info["eos_token_ids"],
                            tensor_parallel_size=info["tensor_parallel_size"],
                            num_kv_blocks=info["num_kv_blocks"])

    async def GetLoad(self, request, context):
        ld = self.load
        return pb.Load(num_running=ld.num_running, num_waiting=ld.num_waiting,
                       kv_blocks_used=ld.kv_blocks_used, kv_blocks_total=ld.kv_blocks_total,
                       tokens_in_flight=ld.tokens_in_flight,
                       accepting=(self.accepting and self.core_error is None
                                  and not self.core_stalled))

    async def SubscribeKvEvents(self, request, context):
        self._wait_ready()
        queue: asyncio.Queue = asyncio.Queue()
        after = request.after_sequence_number
        oldest = self.kv_history[0].sequence_number if self.kv_history else self.kv_seq + 1
        # Resume only when every batch after `after` is still held; otherwise re-snapshot.
        if after and oldest - 1 <= after <= self.kv_seq:
            backlog = [b for b in self.kv_history if b.sequence_number > after]
        else:
            backlog = [self._kv_snapshot()]
        self.kv_subscribers.add(queue)  # no await since the backlog: nothing is missed
        try:
            for batch in backlog:
                yield batch
            while True:
                yield await queue.get()
        finally:
            self.kv_subscribers.discard(queue)

    async def GetTokenizer(self, request, context):
        files = self.tokenizer.files if self.tokenizer is not None else {}
        for name, data in files.items():  # read at start-up: no disk I/O on the event loop
            for start in range(0, max(len(data), 1), TOKENIZER_PIECE_BYTES):
                piece = data[start:start + TOKENIZER_PIECE_BYTES]
                last = start + TOKENIZER_PIECE_BYTES >= len(data)
                yield pb.TokenizerFile(name=name, content=piece, last=last)

    def _wait_ready(self) -> None:
        if not self.ready.is_set():
            self._refuse(grpc.StatusCode.UNAVAILABLE, "engine is still loading the model")
