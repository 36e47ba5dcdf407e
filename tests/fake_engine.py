"""An in-process fake nanoserve engine for client and router tests (no torch, no model).

    fake, port = start_fake_engine(engine_id="e0", behavior=FakeBehavior(kv_block_size=4))
    ...
    fake.stop()

It serves `Generation`, `Engine`, grpc health and reflection on 127.0.0.1 like a real
engine, with tokens that plain arithmetic predicts:

- Prompt token ids: `token_ids` as given; `text` -> its UTF-8 bytes; chat `messages` ->
  the UTF-8 bytes of `render_chat(messages)` ("role: content\\n" per turn, then "assistant: ").
- Each next token is `(previous + 1) % vocab_size`, starting from the last prompt token,
  whatever the sampling parameters (the fake is "greedy" at every temperature).
- A token's text is `token_text(t)` = f" {t}"; stop tokens and eos add no text.
- Ends with "stop" on a stop string (text cut before it, stop_reason = the string; no
  hold-back, so a stop string spanning two chunks leaves its first part in earlier text), on
  a `stop_token_ids` hit (stop_reason = str(id)) or on `eos_token_id` unless ignore_eos
  (stop_reason ""), both only after min_tokens; "length" at max_tokens (default 16).
- `tokens_per_chunk` tokens per chunk; the last chunk carries finish_reason and usage.
- Prefix cache: the prompt's full blocks are hashed with engine_service.common.block_hash (as the
  real engine does); cached_prompt_tokens = leading blocks already held x kv_block_size,
  capped at prompt length - 1; new blocks are stored at admission (KV "stored" events)
  and the least recently used ones evicted past `num_kv_blocks` ("removed" events).
  Event sequence numbers count single events (one per hash).

Errors it can inject (FakeBehavior fields may be changed while it runs):
- INVALID_ARGUMENT: missing/empty prompt, token id >= vocab_size, max_tokens of 0 or above
  `max_tokens_limit`, prompt + max_tokens > max_model_len, duplicate in-flight request_id.
- UNAVAILABLE "draining" when `accepting` is False.
- UNAUTHENTICATED for Generate/Stream without `authorization: Bearer KEY` when `api_key` is set.
- `reject_code`: every Generate/Stream fails at once with that code (only the next
  `reject_count` calls when that is set).
- `fail_after_tokens`: a request that has sent that many tokens aborts with `fail_code`
  (UNAVAILABLE by default), like a crashed engine mid-stream.
- `token_delay_s`: sleeps before each chunk (a slow engine, for deadline tests).
- `stall_after_tokens`: a request that has sent that many tokens sends nothing more, its
  RPC left open, until the field changes or the RPC ends (a hung engine; 0: no token at all).

What it saw: `fake.requests` (every GenerateRequest received, in order), `fake.cancelled`
(request ids whose RPC the client cancelled or let expire before the last chunk),
`fake.finished` (ids that completed), `fake.failed` (ids failed by fail_after_tokens).
`fake.wait_until(pred)` waits for a condition on these. KV helpers: `store_blocks`,
`remove_blocks`, `cached_hashes`, `break_kv_streams`; `set_serving(False)` flips health.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_service.common.api_key import GRPC_REFUSAL, HEADER, bearer_matches
from engine_service.common.block_hash import HASH_SCHEME, hash_prompt_blocks
from engine_service.common.tls import add_port
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc

SERVICE_NAMES = ("nanoserve.v1.Generation", "nanoserve.v1.Engine")


@dataclass
class FakeBehavior:
    vocab_size: int = 1000
    eos_token_id: int = 999
    max_model_len: int = 4096
    kv_block_size: int = 4
    num_kv_blocks: int = 256
    model_name: str = "fake-model"
    max_tokens_limit: int = 1000
    tokens_per_chunk: int = 1
    token_delay_s: float = 0.0
    accepting: bool = True
    reject_code: grpc.StatusCode | None = None
    reject_count: int | None = None
    fail_after_tokens: int | None = None
    fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    stall_after_tokens: int | None = None
    tokenizer_dir: str | None = None
    tokenizer_piece_bytes: int = 64 * 1024
    kv_history_limit: int = 1000  # event batches kept for resuming subscribers
    load: pb.Load | None = None  # a fixed GetLoad answer instead of the computed one
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id must be in [0, {self.vocab_size})")
        if self.kv_block_size < 1 or self.tokens_per_chunk < 1:
            raise ValueError("kv_block_size and tokens_per_chunk must be >= 1")


def render_chat(messages: list[pb.ChatMessage]) -> str:
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant: "


def prompt_token_ids(request: pb.GenerateRequest) -> list[int]:
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "text":
        return list(request.text.encode("utf-8"))
    if kind == "messages":
        return list(render_chat(request.messages.messages).encode("utf-8"))
    return []


def token_text(token_id: int) -> str:
    return f" {token_id}"


@dataclass
class _Run:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    cached_tokens: int
    num_generated: int = 0
    done: bool = False  # reached its finish
    failed: bool = False  # aborted on purpose (fail_after_tokens)


@dataclass
class _Decoded:
    """Decoding state of one request between chunks."""

    last: int
    text: str = ""
    emitted: int = 0  # characters of text already sent
    finish: int = pb.FINISH_REASON_UNSPECIFIED
    stop_reason: str = ""
    token_ids: list[int] = field(default_factory=list)


class FakeEngine(pb_grpc.GenerationServicer, pb_grpc.EngineServicer):
    """The servicer plus its grpc.Server; see the module docstring."""

    def __init__(self, engine_id: str, behavior: FakeBehavior) -> None:
        self.engine_id = engine_id
        self.behavior = behavior
        self.port = 0
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.finished: list[str] = []
        self.failed: list[str] = []
        self._cond = threading.Condition()
        self._running: dict[str, _Run] = {}
        self._num_auto_ids = 0
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self._events: list[pb.KvEventBatch] = []
        self._events_base = 0  # sequence number just before self._events[0]
        self._seq = 0
        self._kv_epoch = 0  # bumped by break_kv_streams()
        self._stopped = False
        self._health = health.HealthServicer()
        self._server: grpc.Server | None = None

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, host: str, port: int, max_workers: int = 32,
              credentials: grpc.ServerCredentials | None = None) -> int:
        # every open stream (Stream, SubscribeKvEvents) holds one worker thread
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers))
        pb_grpc.add_GenerationServicer_to_server(self, self._server)
        pb_grpc.add_EngineServicer_to_server(self, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        self.port = add_port(self._server, f"{host}:{port}", credentials)
        self.set_serving(True)
        self._server.start()
        return self.port

    def stop(self, grace: float | None = None) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.stop(grace).wait()

    def __enter__(self) -> FakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *SERVICE_NAMES):
            self._health.set(name, status)

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Wait until predicate() (evaluated on every state change) is true."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    # -- KV cache and events -----------------------------------------------------------

    def store_blocks(self, hashes: list[int]) -> None:
        """Mark hashes cached (as if a request filled them), evicting LRU blocks past
        num_kv_blocks; publishes the stored/removed events."""
        with self._cond:
            self._store_locked(hashes)

    def remove_blocks(self, hashes: list[int]) -> None:
        with self._cond:
            removed = [h for h in hashes if h in self._cached]
            for h in removed:
                del self._cached[h]
            self._publish_locked([], removed)

    def cached_hashes(self) -> list[int]:
        with self._cond:
            return list(self._cached)

    def break_kv_streams(self) -> None:
        """End every open SubscribeKvEvents stream with UNAVAILABLE (subscribers resume)."""
        with self._cond:
            self._kv_epoch += 1
            self._cond.notify_all()

    def _store_locked(self, hashes: list[int]) -> None:
        stored = []
        for h in hashes:
            if h in self._cached:
                self._cached.move_to_end(h)
            else:
                self._cached[h] = None
                stored.append(h)
        removed = []
        while len(self._cached) > self.behavior.num_kv_blocks:
            removed.append(self._cached.popitem(last=False)[0])
        self._publish_locked(stored, removed)

    def _publish_locked(self, stored: list[int], removed: list[int]) -> None:
        if not stored and not removed:
            return
        self._seq += 1  # one number per batch, as engines number them
        self._events.append(pb.KvEventBatch(
            sequence_number=self._seq, block_hashes_stored=stored,
            block_hashes_removed=removed, kv_block_size=self.behavior.kv_block_size))
        excess = len(self._events) - self.behavior.kv_history_limit
        if excess > 0:
            self._events_base = self._events[excess - 1].sequence_number
            del self._events[:excess]
        self._cond.notify_all()

    def _events_after_locked(self, after: int) -> list[pb.KvEventBatch] | None:
        """Batches after sequence number `after`, or None when they cannot be replayed."""
        if after == self._events_base:
            return list(self._events)
        for i, batch in enumerate(self._events):
            if batch.sequence_number == after:
                return self._events[i + 1:]
        return None

    # -- Generation ----------------------------------------------------------------------

    def Generate(self, request: pb.GenerateRequest,
                 context: grpc.ServicerContext) -> pb.GenerateResponse:
        response = pb.GenerateResponse()
        for chunk in self._generate(request, context):
            response.request_id = chunk.request_id
            response.token_ids.extend(chunk.token_ids)
            response.text += chunk.text
            response.logprobs.extend(chunk.logprobs)
            response.finish_reason = chunk.finish_reason
            response.stop_reason = chunk.stop_reason
            if chunk.HasField("usage"):
                response.usage.CopyFrom(chunk.usage)
            response.engine_id = chunk.engine_id
        return response

    def Stream(self, request: pb.GenerateRequest,
               context: grpc.ServicerContext) -> Iterator[pb.GenerateChunk]:
        yield from self._generate(request, context)

    def _generate(self, request: pb.GenerateRequest,
                  context: grpc.ServicerContext) -> Iterator[pb.GenerateChunk]:
        run = self._admit(request, context)
        context.add_callback(lambda: self._on_rpc_end(run))
        try:
            yield from self._decode(run, request.sampling, context)
        finally:
            self._on_rpc_end(run)

    def _admit(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> _Run:
        key = self.behavior.api_key
        if key is not None and not bearer_matches(
                dict(context.invocation_metadata()).get(HEADER), key):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, GRPC_REFUSAL)
        with self._cond:
            self.requests.append(pb.GenerateRequest.FromString(request.SerializeToString()))
            self._cond.notify_all()
            code, message = self._check_locked(request)
            if code is None:
                run = self._register_locked(request)
        if code is not None:
            context.abort(code, message)
        return run

    def _check_locked(self, request: pb.GenerateRequest) -> tuple[grpc.StatusCode | None, str]:
        b = self.behavior
        if b.reject_code is not None and b.reject_count != 0:
            if b.reject_count is not None:
                b.reject_count -= 1
            return b.reject_code, f"fake engine {self.engine_id} rejects requests"
        if not b.accepting:
            return grpc.StatusCode.UNAVAILABLE, f"engine {self.engine_id} is draining"
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        if request.WhichOneof("prompt") is None:
            return invalid, "prompt is missing: set text, token_ids or messages"
        ids = prompt_token_ids(request)
        if not ids:
            return invalid, "prompt is empty"
        bad = [t for t in ids if t >= b.vocab_size]
        if bad:
            return invalid, f"token id {bad[0]} is out of range [0, {b.vocab_size})"
        sampling = request.sampling
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
        if not 1 <= max_tokens <= b.max_tokens_limit:
            return invalid, f"max_tokens must be in [1, {b.max_tokens_limit}], got {max_tokens}"
        if len(ids) + max_tokens > b.max_model_len:
            return invalid, (f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len {b.max_model_len}")
        if request.request_id in self._running:
            return invalid, f"request_id {request.request_id!r} is already in flight"
        return None, ""

    def _register_locked(self, request: pb.GenerateRequest) -> _Run:
        request_id = request.request_id
        if not request_id:
            self._num_auto_ids += 1
            request_id = f"fake-{self._num_auto_ids}"
        ids = prompt_token_ids(request)
        hashes = hash_prompt_blocks(ids, self.behavior.kv_block_size)
        hits = 0
        while hits < len(hashes) and hashes[hits] in self._cached:
            hits += 1
        cached = min(hits * self.behavior.kv_block_size, len(ids) - 1)
        self._store_locked(hashes)
        sampling = request.sampling
        max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else 16
        run = _Run(request_id, ids, max_tokens, cached)
        self._running[request_id] = run
        return run

    def _on_rpc_end(self, run: _Run) -> None:
        """Runs when the handler ends and when the RPC terminates (whichever comes first
        does the bookkeeping): an unfinished run there was cancelled or expired."""
        with self._cond:
            if self._running.get(run.request_id) is not run:
                return
            del self._running[run.request_id]
            outcome = self.failed if run.failed else self.finished if run.done else self.cancelled
            outcome.append(run.request_id)
            self._cond.notify_all()

    def _decode(self, run: _Run, sampling: pb.SamplingParams,
                context: grpc.ServicerContext) -> Iterator[pb.GenerateChunk]:
        b = self.behavior
        state = _Decoded(last=run.prompt_ids[-1])
        while state.finish == pb.FINISH_REASON_UNSPECIFIED:
            if b.token_delay_s:
                time.sleep(b.token_delay_s)
            while (b.stall_after_tokens is not None and run.num_generated >= b.stall_after_tokens
                   and context.is_active() and not self._stopped):
                time.sleep(0.01)
            if not context.is_active():
                return  # cancelled or expired: stop work; _on_rpc_end records it
            budget = b.tokens_per_chunk
            if b.fail_after_tokens is not None:
                if run.num_generated >= b.fail_after_tokens:
                    run.failed = True
                    context.abort(b.fail_code, f"fake engine {self.engine_id} failed after "
                                               f"{run.num_generated} tokens")
                budget = min(budget, b.fail_after_tokens - run.num_generated)
            start = len(state.token_ids)
            for _ in range(budget):
                self._next_token(run, sampling, state)
                if state.finish != pb.FINISH_REASON_UNSPECIFIED:
                    run.done = True
                    break
            yield self._chunk(run, sampling, state, start)

    def _next_token(self, run: _Run, sampling: pb.SamplingParams, state: _Decoded) -> None:
        b = self.behavior
        token = (state.last + 1) % b.vocab_size
        state.last = token
        state.token_ids.append(token)
        run.num_generated += 1
        may_stop = run.num_generated >= sampling.min_tokens
        if may_stop and token in sampling.stop_token_ids:
            state.finish, state.stop_reason = pb.FINISH_REASON_STOP, str(token)
        elif may_stop and token == b.eos_token_id and not sampling.ignore_eos:
            state.finish = pb.FINISH_REASON_STOP
        else:
            state.text += token_text(token)
            hits = [(state.text.find(s), s) for s in sampling.stop if s in state.text]
            if hits:
                cut, stop = min(hits)
                state.text = state.text[:cut]
                state.finish, state.stop_reason = pb.FINISH_REASON_STOP, stop
        if state.finish == pb.FINISH_REASON_UNSPECIFIED and run.num_generated >= run.max_tokens:
            state.finish = pb.FINISH_REASON_LENGTH

    def _chunk(self, run: _Run, sampling: pb.SamplingParams, state: _Decoded,
               start: int) -> pb.GenerateChunk:
        new_ids = state.token_ids[start:]
        chunk = pb.GenerateChunk(request_id=run.request_id, token_ids=new_ids,
                                 text=state.text[state.emitted:], engine_id=self.engine_id)
        state.emitted = max(state.emitted, len(state.text))
        if sampling.HasField("logprobs"):
            vocab = self.behavior.vocab_size
            for t in new_ids:
                top = [(t + i) % vocab for i in range(sampling.logprobs)]
                chunk.logprobs.add(token_id=t, logprob=-0.25, top_token_ids=top,
                                   top_logprobs=[-0.25 - i for i in range(len(top))])
        if state.finish != pb.FINISH_REASON_UNSPECIFIED:
            chunk.finish_reason = state.finish
            chunk.stop_reason = state.stop_reason
            chunk.usage.CopyFrom(pb.Usage(prompt_tokens=len(run.prompt_ids),
                                          completion_tokens=run.num_generated,
                                          cached_prompt_tokens=run.cached_tokens))
        return chunk

    # -- Engine --------------------------------------------------------------------------

    def GetModelInfo(self, request: pb.GetModelInfoRequest,
                     context: grpc.ServicerContext) -> pb.ModelInfo:
        b = self.behavior
        return pb.ModelInfo(
            model_name=b.model_name, architecture="FakeForCausalLM",
            max_model_len=b.max_model_len, kv_block_size=b.kv_block_size,
            hash_scheme=HASH_SCHEME, vocab_size=b.vocab_size, eos_token_ids=[b.eos_token_id],
            tensor_parallel_size=1, engine_id=self.engine_id, num_kv_blocks=b.num_kv_blocks)

    def GetLoad(self, request: pb.GetLoadRequest, context: grpc.ServicerContext) -> pb.Load:
        b = self.behavior
        if b.load is not None:
            return b.load
        with self._cond:
            runs = list(self._running.values())
        bs = b.kv_block_size
        return pb.Load(
            num_running=len(runs), num_waiting=0,
            kv_blocks_used=sum(-(-(len(r.prompt_ids) + r.num_generated) // bs) for r in runs),
            kv_blocks_total=b.num_kv_blocks,
            tokens_in_flight=sum(r.max_tokens - r.num_generated for r in runs),
            accepting=b.accepting)

    def SubscribeKvEvents(self, request: pb.SubscribeKvEventsRequest,
                          context: grpc.ServicerContext) -> Iterator[pb.KvEventBatch]:
        with self._cond:
            epoch = self._kv_epoch
            backlog = None
            if request.after_sequence_number > 0:
                backlog = self._events_after_locked(request.after_sequence_number)
            if backlog is None:
                backlog = [pb.KvEventBatch(
                    sequence_number=self._seq, snapshot=True,
                    block_hashes_stored=list(self._cached),
                    kv_block_size=self.behavior.kv_block_size)]
            sent = backlog[-1].sequence_number if backlog else request.after_sequence_number
        yield from backlog
        while context.is_active():
            with self._cond:
                self._cond.wait_for(lambda sent=sent: self._seq > sent or self._kv_epoch != epoch
                                    or self._stopped, timeout=0.1)
                if self._stopped:
                    return
                if self._kv_epoch != epoch:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "KV event stream broken (test)")
                # None: history trimmed past `sent`; the subscriber resumes and gets a snapshot
                batches = self._events_after_locked(sent)
            if batches is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, "KV event history lost")
            for batch in batches:
                sent = batch.sequence_number
                yield batch

    def GetTokenizer(self, request: pb.GetTokenizerRequest,
                     context: grpc.ServicerContext) -> Iterator[pb.TokenizerFile]:
        directory = self.behavior.tokenizer_dir
        if directory is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "this fake engine has no tokenizer_dir")
        piece = self.behavior.tokenizer_piece_bytes
        for path in sorted(p for p in Path(directory).iterdir() if p.is_file()):
            data = path.read_bytes()
            starts = range(0, len(data), piece) if data else [0]
            for start in starts:
                yield pb.TokenizerFile(name=path.name, content=data[start:start + piece],
                                       last=start + piece >= len(data))


def start_fake_engine(port: int = 0, engine_id: str | None = None,
                      behavior: FakeBehavior | None = None, host: str = "127.0.0.1",
                      max_workers: int = 32,
                      credentials: grpc.ServerCredentials | None = None
                      ) -> tuple[FakeEngine, int]:
    """Start a fake engine (TLS with `credentials`, see engine_service.common.tls);
    engine_id defaults to "host:port". Call `fake.stop()` after."""
    fake = FakeEngine(engine_id or "", behavior or FakeBehavior())
    bound = fake.start(host, port, max_workers, credentials)
    if not engine_id:
        fake.engine_id = f"{host}:{bound}"
    return fake, bound
