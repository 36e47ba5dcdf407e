"""The router's Generation service: tokenize once, route, forward token ids, fail over
(docs/architecture.md, "Router"). Every status it ends an RPC with is `bounded` and raised
as proto_convert.Refused rather than by context.abort.

A continuing engine detokenizes only the tokens it generates, so text the failed one held
back (an incomplete character, a possible stop string) is decoded by the router and owed to
the next chunk (best effort, only without stop strings; token ids are always exact). The
last chunk's usage is rewritten to the client's view (`_to_client_view`). Greedy requests
without presence/frequency penalties continue exactly as one engine would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import random
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from engine_service.common.api_key import api_key_interceptors
from engine_service.common.block_hash import hash_prompt_blocks
from engine_service.common.http_server import HttpServer, bind_http
from engine_service.common.listen import serve_metrics
from engine_service.common.openai_protocol import ModelCard
from engine_service.common.proto_convert import (
    MAX_REQUEST_BYTES,
    Refused,
    StatusInterceptor,
    cancel_code,
    check_prompt_bytes,
    diffusion_params_to_proto,
    prompt_ids_from_proto,
    sampling_params_from_request,
    unary_from_stream,
)
from engine_service.common.sampling_params import (
    DIFFUSION_ARCHITECTURES,
    DiffusionParams,
    SamplingParams,
    check_field,
    check_prompt_len,
    quote,
)
from engine_service.common.serving import SERVING, Health, start_openai
from engine_service.common.tls import add_port, server_credentials
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc
from router.admission import RETRY_AFTER_S, Admission, Rejected
from router.config import RouterConfig
from router.engine_pool import EngineClient, EnginePool, Resolver, resolve_dns
from router.metrics import RouterMetrics
from router.policy import REASON_CONTINUATION, REASON_RETRY, Candidate, Decision, choose
from router.prefix_index import PrefixIndex
from router.tokenizer_source import TokenizerSource, TokenizerUnavailable

log = logging.getLogger("nanoserve.router")

Code = grpc.StatusCode
# Worth another engine: the engine broke, is overloaded or went away. UNKNOWN is not:
# it is what an engine's handler raising on this very request gives, so it goes to the
# client as is (retrying would repeat it on every engine and bench them all).
RETRYABLE = frozenset({Code.UNAVAILABLE, Code.INTERNAL, Code.DATA_LOSS, Code.CANCELLED,
                       Code.UNIMPLEMENTED, Code.ABORTED, Code.RESOURCE_EXHAUSTED})
# Counted against the engine's health (a full queue is not a fault).
ENGINE_FAULTS = RETRYABLE - {Code.RESOURCE_EXHAUSTED, Code.ABORTED}
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# A status travels in metadata (16 KiB at most): a message echoing a huge value would break
# the call itself. Values the router quotes go through sampling_params.quote; this caps the
# rest (an engine's message, an exception's text).
MAX_MESSAGE_BYTES = 1024


def bounded(message: str) -> str:
    """`message`, or its first bytes and its length when over MAX_MESSAGE_BYTES of UTF-8."""
    data = message.encode("utf-8")
    if len(data) <= MAX_MESSAGE_BYTES:
        return message
    tail = f"... (length {len(message)})"
    return data[:MAX_MESSAGE_BYTES - len(tail)].decode("utf-8", errors="ignore") + tail


@dataclass
class _Progress:
    """What the client has received of one request, for a continuation."""

    sent_ids: list[int] = field(default_factory=list)
    sent_text: list[str] = field(default_factory=list)
    owed_text: str = ""  # text held back by a failed engine, owed to the next chunk


class _Abort(Refused):
    """End the client's RPC with this status (its message bounded)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(code, bounded(message))


def continuation_request(original: pb.GenerateRequest, request_id: str, prompt_ids: list[int],
                         sent_ids: list[int], max_tokens: int,
                         diffusion: DiffusionParams | None = None) -> pb.GenerateRequest:
    """The request for the engine: the prompt as token ids; after a failover, prompt + tokens
    already sent, with max_tokens / min_tokens reduced by what was sent (seed unchanged), or
    for a diffusion model's request (`diffusion`: its decoding, defaults included) gen_length
    and steps reduced by the blocks sent."""
    request = pb.GenerateRequest(request_id=request_id, priority=original.priority)
    request.sampling.CopyFrom(original.sampling)
    if original.HasField("diffusion"):
        request.diffusion.CopyFrom(original.diffusion)
    request.token_ids.ids.extend(prompt_ids)
    if sent_ids and diffusion is not None:
        request.token_ids.ids.extend(sent_ids)
        request.diffusion.CopyFrom(diffusion_params_to_proto(
            rest_of_canvas(diffusion, len(sent_ids))))
    elif sent_ids:
        request.token_ids.ids.extend(sent_ids)
        request.sampling.max_tokens = max_tokens - len(sent_ids)
        if request.sampling.min_tokens:
            request.sampling.min_tokens = max(request.sampling.min_tokens - len(sent_ids), 0)
    return request


def rest_of_canvas(p: DiffusionParams, num_sent: int) -> DiffusionParams:
    """The decoding of a diffusion request's canvas after its first `num_sent` positions,
    whole blocks (an engine sends only final blocks)."""
    blocks_left = (p.gen_length - num_sent) // p.block_length
    return dataclasses.replace(p, gen_length=blocks_left * p.block_length,
                               steps=blocks_left * p.steps_per_block)


def held_back_text(tokenizer, sent_ids: list[int], sent_text: str,
                   skip_special_tokens: bool) -> str:
    """Text of `sent_ids` that the client has not received (best effort, see module doc)."""
    decode = getattr(tokenizer, "decode", None)
    if decode is None or not sent_ids:
        return ""
    full = decode(sent_ids, skip_special_tokens=skip_special_tokens)
    if not full.startswith(sent_text):
        return ""
    return full[len(sent_text):].rstrip("\ufffd")


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, config: RouterConfig, pool: EnginePool, index: PrefixIndex,
                 tokenizers: TokenizerSource, metrics: RouterMetrics) -> None:
        self.config = config
        self.policy = config.policy_config()
        self.pool = pool
        self.index = index
        self.tokenizers = tokenizers
        self.metrics = metrics
        self._rng = random.Random(config.seed)
        self._rr = itertools.count()
        # client request_id -> the token of the request holding it
        self.request_ids_in_flight: dict[str, object] = {}
        self.admission = Admission(config.max_concurrent_requests, config.max_queued_requests,
                                   config.queue_timeout)
        metrics.admitted.labels("in_flight").set_function(lambda: self.admission.in_flight)
        metrics.admitted.labels("queued").set_function(lambda: self.admission.queued)

    # ---- RPCs -------------------------------------------------------------------------

    async def Stream(self, request: pb.GenerateRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        try:
            async with contextlib.aclosing(self._run(request, context)) as chunks:
                async for chunk in chunks:
                    yield chunk
        except _Abort as e:
            self.metrics.errors.labels(e.code.name).inc()
            raise
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.errors.labels(cancel_code(context)).inc()
            raise

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        return await unary_from_stream(self.Stream(request, context))

    # ---- one request ------------------------------------------------------------------

    async def _run(self, request: pb.GenerateRequest,
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        try:  # the engines check again; checking here keeps a bad request off the index
            params = sampling_params_from_request(request)
        except ValueError as e:
            raise _Abort(Code.INVALID_ARGUMENT, str(e)) from None
        with contextlib.ExitStack() as held:  # released as the request ends, however
            held.callback(self._hold_request_id(request.request_id, context))
            held.callback(await self._admit(context, request.priority))
            prompt_ids = await self._prompt_ids(request)
            chunks = self._attempts(request, params, prompt_ids, context)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk

    def _hold_request_id(self, request_id: str,
                         context: grpc.aio.ServicerContext) -> Callable[..., None]:
        """Refuse a client's request_id that is in flight through this router, else hold it;
        returns its release, which also runs when the RPC ends (a dropped handler)."""
        if not request_id:
            return lambda *_: None
        try:  # the engines' check, in their words
            check_field(request_id not in self.request_ids_in_flight, "request_id",
                        "unique among requests in flight", request_id)
        except ValueError as e:
            raise _Abort(Code.INVALID_ARGUMENT, str(e)) from None
        token = object()
        self.request_ids_in_flight[request_id] = token

        def release(*_: object) -> None:
            if self.request_ids_in_flight.get(request_id) is token:
                del self.request_ids_in_flight[request_id]

        context.add_done_callback(release)
        return release

    async def _admit(self, context: grpc.aio.ServicerContext,
                     priority: int) -> Callable[..., None]:
        """A --max-concurrent-requests slot, held until the RPC ends (released as in
        _hold_request_id); or RESOURCE_EXHAUSTED with a retry-after hint in seconds in the
        trailing metadata, for an HTTP front's 429 + Retry-After."""
        try:
            release = await self.admission.acquire(priority)
        except Rejected as e:
            self.metrics.rejected.labels(e.reason).inc()
            context.set_trailing_metadata((("retry-after", str(RETRY_AFTER_S)),))
            raise _Abort(Code.RESOURCE_EXHAUSTED, str(e)) from None
        context.add_done_callback(release)
        return release

    async def _attempts(self, request: pb.GenerateRequest, params: SamplingParams,
                        prompt_ids: list[int], context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.GenerateChunk]:
        """The request on one engine after another until one finishes it."""
        request_id = request.request_id or uuid.uuid4().hex
        diffusion = self._diffusion(params)
        max_tokens = params.max_tokens if diffusion is None else diffusion.gen_length
        progress = _Progress()
        tried: set[str] = set()
        errors: list[tuple[str, grpc.StatusCode, str]] = []
        engine: EngineClient | None = None
        for attempt in range(self.config.max_attempts):
            if len(progress.sent_ids) >= max_tokens:
                break  # every token went out before the engine failed
            again = REASON_CONTINUATION if progress.sent_ids else REASON_RETRY if tried else None
            routed = self._route(request_id, prompt_ids + progress.sent_ids, tried,
                                 max_tokens - len(progress.sent_ids), again)
            if routed is None:
                break
            engine, handle = routed
            tried.add(engine.key)
            chunks = self._forward(engine, handle, request, request_id, prompt_ids,
                                   max_tokens, diffusion, progress, context)
            try:
                async with contextlib.aclosing(chunks):
                    async for chunk in chunks:
                        yield chunk
                engine.record_success()
                return
            except grpc.aio.AioRpcError as e:
                errors.append(self._engine_failed(engine, handle, e, params, request_id,
                                                  progress, attempt))
            finally:
                engine.end_request(handle)
        if progress.sent_ids and len(progress.sent_ids) >= max_tokens:
            yield self._length_chunk(request_id, prompt_ids, progress, engine)
            return
        raise self._unavailable(request_id, errors)

    async def _forward(self, engine: EngineClient, handle: int, request: pb.GenerateRequest,
                       request_id: str, prompt_ids: list[int], max_tokens: int,
                       diffusion: DiffusionParams | None, progress: _Progress,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        """One engine's stream, as the client must see it; raises the engine's AioRpcError,
        or UNAVAILABLE when the engine pool abandoned the call (a stall)."""
        num_sent_before = len(progress.sent_ids)
        engine_request = continuation_request(request, request_id, prompt_ids,
                                              progress.sent_ids, max_tokens, diffusion)
        call = engine.generation.Stream(engine_request, timeout=_time_left(context))
        engine.watch(handle, call)
        try:
            async for chunk in call:
                engine.chunk_arrived(handle)
                if num_sent_before and chunk.HasField("usage"):
                    _to_client_view(chunk.usage, len(prompt_ids), num_sent_before)
                if progress.owed_text:
                    chunk.text = progress.owed_text + chunk.text
                    progress.owed_text = ""
                yield chunk
                progress.sent_ids.extend(chunk.token_ids)
                progress.sent_text.append(chunk.text)
                engine.awaiting_chunk(handle)
        except asyncio.CancelledError:
            why = engine.abandoned(handle)
            if why is None or context.done():
                raise  # the client went away
            raise grpc.aio.AioRpcError(Code.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), why) from None
        finally:
            call.cancel()  # no-op when done; propagates client cancellation otherwise

    def _diffusion(self, params: SamplingParams) -> DiffusionParams | None:
        """A diffusion model's request: its decoding (the defaults when it sets none); None
        for an autoregressive one. A router's engines serve one model, so any one's kind."""
        if params.diffusion is not None:
            return params.diffusion
        if any(e.is_diffusion for e in self.pool.engines()):
            return DiffusionParams()
        return None

    def _engine_failed(self, engine: EngineClient, handle: int, error: grpc.aio.AioRpcError,
                       params: SamplingParams, request_id: str, progress: _Progress,
                       attempt: int) -> tuple[str, grpc.StatusCode, str]:
        """Classify an engine's error: pass it to the client (raises _Abort) or note it and
        let the caller try another engine."""
        code, details = error.code(), bounded(error.details() or "")
        if code not in RETRYABLE:
            raise _Abort(code, details)  # the engine's verdict, unchanged
        if code in ENGINE_FAULTS:
            engine.record_failure(code, handle)
        if progress.sent_ids:
            self.metrics.failovers.labels(engine.key).inc()
            if not progress.owed_text:
                progress.owed_text = self._held_back(params, progress)
        else:
            self.metrics.retries.labels(engine.key).inc()
        log.info("request %s: engine %s failed with %s after %d token(s) (attempt %d of %d): %s",
                 request_id, engine.key, code.name, len(progress.sent_ids), attempt + 1,
                 self.config.max_attempts, details)
        return engine.key, code, details

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        """The prompt as token ids; INVALID_ARGUMENT when no engine's max_model_len holds it
        (unchecked while no engine's model info is known)."""
        max_model_len = max((e.info.max_model_len for e in self.pool.engines()
                             if e.info is not None and e.problem is None), default=None)
        try:  # a text too large for any engine costs no tokenizer time
            if max_model_len is not None:
                check_prompt_bytes(request, max_model_len)
        except ValueError as e:
            raise _Abort(Code.INVALID_ARGUMENT, str(e)) from None
        tokenizer = None
        kind = request.WhichOneof("prompt")
        if kind == "text" or (kind == "messages" and request.messages.messages):
            try:
                tokenizer = await self.tokenizers.get(self.pool)
            except TokenizerUnavailable as e:
                raise _Abort(Code.UNAVAILABLE, str(e)) from None
        try:  # tokenizing off the event loop: other streams keep flowing
            ids = await asyncio.to_thread(prompt_ids_from_proto, request, tokenizer)
            if max_model_len is not None:
                check_prompt_len(len(ids), max_model_len)
        except ValueError as e:
            raise _Abort(Code.INVALID_ARGUMENT, str(e)) from None
        return ids

    def _route(self, request_id: str, token_ids: list[int], tried: set[str], max_tokens: int,
               again: str | None) -> tuple[EngineClient, int] | None:
        """Score the engines not yet tried and begin the request on the winner; `again`
        (retry / continuation) replaces the policy's reason in the metrics and the log."""
        engines = [e for e in self.pool.routable()
                   if e.key not in tried and len(token_ids) < e.info.max_model_len]
        if not engines:
            return None
        hashes: dict[int, list[int]] = {}  # block size -> the prompt's block hashes
        candidates = []
        for e in engines:
            bs = e.block_size
            if bs not in hashes:
                hashes[bs] = hash_prompt_blocks(token_ids, bs)
            cached = self.index.match(e.key, hashes[bs]) * bs
            candidates.append(Candidate(e.key, e.load(), cached))
        decision: Decision = choose(candidates, len(token_ids), self.policy, self._rng,
                                    next(self._rr))
        engine = next(e for e in engines if e.key == decision.key)
        chosen = next(c for c in candidates if c.key == decision.key)
        self.index.insert_optimistic(engine.key, hashes[engine.block_size])
        handle = engine.begin_request(len(token_ids) - chosen.cached_tokens + max_tokens)
        reason = again or decision.reason
        self.metrics.requests.labels(engine.key, reason).inc()
        self.metrics.prompt_tokens.labels(engine.key).inc(len(token_ids))
        self.metrics.prefix_matched_tokens.labels(engine.key).inc(chosen.cached_tokens)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route request=%s engine=%s reason=%s prompt_tokens=%d matched_tokens=%d "
                      "cost=%.0f load=%.0f candidates=[%s]", request_id, engine.key,
                      reason, len(token_ids), chosen.cached_tokens, decision.cost,
                      chosen.load, ", ".join(f"{c.key} cached={c.cached_tokens} load={c.load:.0f}"
                                             for c in candidates))
        return engine, handle

    def _held_back(self, params: SamplingParams, progress: _Progress) -> str:
        tokenizer = self.tokenizers.loaded
        if tokenizer is None or params.stop:
            return ""
        skip_special = params.skip_special_tokens
        try:
            return held_back_text(tokenizer, progress.sent_ids, "".join(progress.sent_text),
                                  skip_special)
        except Exception:  # best effort only: never fail a stream over its text
            log.debug("held-back text not recovered", exc_info=True)
            return ""

    def _length_chunk(self, request_id: str, prompt_ids: list[int], progress: _Progress,
                      engine: EngineClient | None) -> pb.GenerateChunk:
        """Every token was sent before the engine failed: end the stream as it would have."""
        return pb.GenerateChunk(
            request_id=request_id, text=progress.owed_text,
            finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=len(prompt_ids),
                           completion_tokens=len(progress.sent_ids)),
            engine_id=engine.engine_id if engine is not None else "")

    def _unavailable(self, request_id: str,
                     errors: list[tuple[str, grpc.StatusCode, str]]) -> _Abort:
        if errors and all(code is Code.RESOURCE_EXHAUSTED for _, code, _ in errors):
            return _Abort(Code.RESOURCE_EXHAUSTED, "every engine tried is at capacity; retry later "
                                                   f"(request {quote(request_id)})")
        tried = "; ".join(f"{key}: {code.name} {details}".strip()
                          for key, code, details in errors)
        states = ", ".join(f"{e.key} ({e.state()})" for e in self.pool.engines()) or "none"
        message = f"no healthy engine could take request {quote(request_id)}"
        if tried:
            message += f"; tried {tried}"
        return _Abort(Code.UNAVAILABLE, f"{message}; engines: {states}")


def _to_client_view(usage: pb.Usage, num_prompt_tokens: int, num_sent_before: int) -> None:
    """A continuing engine counts the tokens sent before as prompt; the client does not."""
    usage.completion_tokens += num_sent_before
    usage.cached_prompt_tokens = min(usage.cached_prompt_tokens, num_prompt_tokens)
    usage.prompt_tokens = num_prompt_tokens


def _time_left(context: grpc.aio.ServicerContext) -> float | None:
    """The client's remaining deadline, passed on to the engine call (None = no deadline)."""
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e8:
        return None
    return max(remaining, 0.0)


class Router:
    """The router process: gRPC server (Generation, health, reflection), engine pool,
    prefix index, metrics endpoint."""

    def __init__(self, config: RouterConfig, resolver: Resolver = resolve_dns) -> None:
        self.config = config
        self.metrics = RouterMetrics()
        self.index = PrefixIndex(config.optimistic_ttl)
        self.pool = EnginePool(config, self.index, self.metrics, resolver)
        self.tokenizers = TokenizerSource(config.tokenizer)
        self.servicer = GenerationServicer(config, self.pool, self.index, self.tokenizers,
                                           self.metrics)
        self.health: Health | None = None  # with the gRPC server
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._metrics_server = None
        self.http: HttpServer | None = None  # the OpenAI HTTP front, once started
        self._health_task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port."""
        self.tokenizers.load_dir()
        # no SO_REUSEPORT: a second router on a taken port must fail, not share it. Engines'
        # limits are not known yet, so room for any prompt they may take; the prompt itself
        # is then checked against the engines' (check_prompt_bytes).
        options = [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_REQUEST_BYTES)]
        server = grpc.aio.server(interceptors=[*api_key_interceptors(self.config.api_key),
                                               StatusInterceptor()], options=options)
        pb_grpc.add_GenerationServicer_to_server(self.servicer, server)
        self.health = Health(server, (SERVICE_NAME,))
        self.port = add_port(server, f"{self.config.host}:{self.config.port}",
                             server_credentials(self.config.tls_cert, self.config.tls_key))
        if self.config.metrics_port:  # bound before serving: a taken port fails start-up
            self._metrics_server = serve_metrics(self.metrics.registry, self.config.host,
                                                 self.config.metrics_port)
        http_port = self.config.http_port
        http_socket = None if http_port is None else bind_http(self.config.host, http_port)
        await self.health.set(False)
        # "liveness" answers SERVING while the process runs: a liveness probe on "" would
        # restart every router while its engines are still loading.
        await self.health.servicer.set("liveness", SERVING)
        await server.start()
        self._server = server
        await self.pool.start()
        self._health_task = asyncio.create_task(self._health_loop(), name="router-health")
        log.info("router listening on %s:%d (policy %s)", self.config.host, self.port,
                 self.config.policy)
        if http_socket is not None:
            self.http = await start_openai(
                http_socket, self.config.serving_options(), stream=self.servicer.Stream,
                model=self.model_card, serving=lambda: self.health.serving,
                tokenizer=lambda: self.tokenizers.loaded, registry=self.metrics.registry)
            log.info("router OpenAI API on %s://%s:%d", self.http.scheme, self.config.host,
                     self.http.port)
        return self.port

    def model_card(self) -> ModelCard | None:
        """The model the HTTP front serves: --served-model-name or the engines' name, with
        the largest max_model_len among them; None before any engine reported its model."""
        infos = [e.info for e in self.pool.engines() if e.info is not None and e.problem is None]
        if not infos:
            return None
        return ModelCard(self.config.served_model_name or infos[0].model_name,
                         max(i.max_model_len for i in infos), infos[0].vocab_size,
                         infos[0].architecture in DIFFUSION_ARCHITECTURES)

    async def stop(self, grace: float | None = None) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._server is not None:
            await self.health.set(False)
            await asyncio.gather(self._server.stop(grace), *(
                [self.http.stop(grace or 0)] if self.http is not None else []))
        await self.pool.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server = None

    async def wait_for_termination(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()

    async def _health_loop(self) -> None:
        """SERVING while at least one engine can take requests; the first time only once one
        of them has its KV snapshot in, so a restarted router never routes by load alone
        (later snapshot gaps do not turn it NOT_SERVING)."""
        serving = None
        synced = False
        while True:
            routable = self.pool.routable()
            synced = synced or any(self.index.has_snapshot(e.key) for e in routable)
            now_serving = bool(routable) and synced
            if now_serving != serving:
                await self.health.set(now_serving)
                serving = now_serving
            self.index.expire()
            await asyncio.sleep(min(self.config.health_interval, 0.5))
