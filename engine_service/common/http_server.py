"""The OpenAI-compatible HTTP front of an engine or a router, in the process's own asyncio loop.

Each HTTP request becomes pb.GenerateRequests (openai_protocol.generate_requests) that go to
the process's Generation servicer exactly as gRPC calls reach it (its Stream handler, with
an HttpCallContext for the grpc context); its chunks come back as OpenAI JSON or SSE. A
handler's Refused becomes an OpenAI error object: INVALID_ARGUMENT 400, UNAUTHENTICATED 401,
NOT_FOUND 404, RESOURCE_EXHAUSTED 429 (Retry-After from the call's trailing metadata),
UNAVAILABLE 503, anything else 500. A body over MAX_REQUEST_BYTES (the gRPC servers' limit)
is 413, refused before it is read whole. A client that disconnects cancels the servicer's
generator, so the engine aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from engine_service.common.api_key import bearer_matches
from engine_service.common.listen import cannot_listen
from engine_service.common.openai_protocol import (
    DONE_EVENT,
    ChatRequest,
    CompletionRequest,
    ModelCard,
    ResponseBuilder,
    generate_requests,
    sse_event,
)
from engine_service.common.proto_convert import MAX_REQUEST_BYTES, Refused, add_chunk
from engine_service.common.sampling_params import quote
from engine_service.common.tls import rotating_server_context
from nanoserve.v1 import nanoserve_pb2 as pb

if TYPE_CHECKING:
    from engine_service.common.tokenizer import Tokenizer

log = logging.getLogger("nanoserve.http")
T = TypeVar("T")
Code = grpc.StatusCode
HTTP_STATUS = {Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
               Code.UNAUTHENTICATED: (401, "authentication_error"),
               Code.NOT_FOUND: (404, "not_found_error"),
               Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
               Code.UNAVAILABLE: (503, "service_unavailable_error")}
DEFAULT_RETRY_AFTER_S = "1"
_FIELD = re.compile(r"([\w.\[\]]+) (?:must be|applies to) ")


class HttpCallContext:
    """The grpc.aio.ServicerContext methods the servicers use, for one call from the HTTP
    front. Done callbacks run once the call's stream has ended, however it ended."""

    def __init__(self) -> None:
        self.trailing_metadata: tuple[tuple[str, str], ...] = ()
        self._callbacks: list[Callable[[Any], None]] = []
        self._done = False

    def time_remaining(self) -> float | None:
        return None  # HTTP requests carry no deadline

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self._done:
            callback(self)
        else:
            self._callbacks.append(callback)

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing_metadata = tuple(metadata)

    def done(self) -> bool:
        return self._done

    def finish(self) -> None:
        self._done = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)


class HttpError(Exception):
    """An OpenAI error object with its HTTP status; `param` defaults to the field the
    message names ("temperature must be ...", "top_p applies to autoregressive models")."""

    def __init__(self, code: grpc.StatusCode, message: str, *, param: str | None = None,
                 error_code: str | None = None, headers: dict[str, str] | None = None,
                 status: int | None = None) -> None:
        super().__init__(message)
        self.status, default_kind = HTTP_STATUS.get(code, (500, "server_error"))
        self.status = status or self.status
        match = _FIELD.match(message)
        self.body = {"error": {"message": message, "type": default_kind,
                               "param": param or (match.group(1) if match else None),
                               "code": error_code or code.name.lower()}}
        self.headers = headers

    @classmethod
    def from_refused(cls, refused: Refused, context: HttpCallContext) -> HttpError:
        headers = None
        if refused.code is Code.RESOURCE_EXHAUSTED:
            hint = dict(context.trailing_metadata).get("retry-after", DEFAULT_RETRY_AFTER_S)
            headers = {"Retry-After": hint}
        return cls(refused.code, str(refused), headers=headers)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


Stream = Callable[[pb.GenerateRequest, HttpCallContext], AsyncIterator[pb.GenerateChunk]]


async def _one(stream: Stream, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateChunk]:
    """One servicer call: its Refused as an HttpError, its done callbacks once it ends."""
    context = HttpCallContext()
    try:
        async with contextlib.aclosing(stream(request, context)) as chunks:
            async for chunk in chunks:
                yield chunk
    except Refused as e:
        raise HttpError.from_refused(e, context) from None
    finally:
        context.finish()


async def run_choices(stream: Stream, requests: list[pb.GenerateRequest]
                      ) -> AsyncIterator[tuple[int, pb.GenerateChunk]]:
    """Every request's chunks with its index, as they come; the requests run concurrently.
    The first error ends the whole, and closing it early cancels every request."""
    if len(requests) == 1:  # the usual case, without a task per request
        async with contextlib.aclosing(_one(stream, requests[0])) as chunks:
            async for chunk in chunks:
                yield 0, chunk
        return
    queue: asyncio.Queue[tuple[int, pb.GenerateChunk | Exception | None]] = asyncio.Queue()

    async def pump(index: int, request: pb.GenerateRequest) -> None:
        try:
            async with contextlib.aclosing(_one(stream, request)) as chunks:
                async for chunk in chunks:
                    queue.put_nowait((index, chunk))
            queue.put_nowait((index, None))
        except Exception as e:  # handed to the reader, which raises it
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _collect(choices: AsyncIterator[tuple[int, pb.GenerateChunk]],
                   count: int) -> list[pb.GenerateResponse]:
    outs = [pb.GenerateResponse() for _ in range(count)]
    async with contextlib.aclosing(choices):
        async for index, chunk in choices:
            add_chunk(outs[index], chunk)
    return outs


async def _read_body(request: Request) -> bytes:
    """The body, or a 413 once it is known to be over MAX_REQUEST_BYTES: from Content-Length
    before any of it is read, else as soon as what has come exceeds it."""
    declared = request.headers.get("content-length", "")
    if declared.isdecimal() and int(declared) > MAX_REQUEST_BYTES:
        raise _too_large(declared)
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > MAX_REQUEST_BYTES:
            raise _too_large(f"at least {size}")
        parts.append(part)
    return b"".join(parts)


def _too_large(size: str) -> HttpError:
    return HttpError(Code.INVALID_ARGUMENT, f"request body must be at most {MAX_REQUEST_BYTES} "
                     f"bytes, got {size}", error_code="request_too_large", status=413)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the client disconnects first (then `work` is
    cancelled, which aborts its requests)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return await task
    return None


class _SseResponse(StreamingResponse):
    """Server-sent events whose generator is closed as soon as the response ends, however
    it ends: a client that disconnects aborts its requests now, not at garbage collection."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _sse(builder: ResponseBuilder, count: int, first: tuple[int, pb.GenerateChunk],
               choices: AsyncIterator[tuple[int, pb.GenerateChunk]]) -> AsyncIterator[bytes]:
    async with contextlib.aclosing(choices):
        for event in builder.sse_start(count):
            yield event
        yield builder.sse_chunk(*first)
        try:
            async for index, chunk in choices:
                yield builder.sse_chunk(index, chunk)
        except HttpError as e:  # the status line went out with the first chunk
            yield sse_event(e.body)
            yield DONE_EVENT
            return
    for event in builder.sse_end():
        yield event


@dataclass
class Backend:
    """What the HTTP front uses of the process it runs in."""

    stream: Stream  # the Generation servicer's Stream handler
    model: Callable[[], ModelCard | None]  # None until the model is known
    serving: Callable[[], bool]  # the gRPC health state: SERVING or not
    tokenizer: Callable[[], Tokenizer | None]  # for logprobs' token strings
    registry: CollectorRegistry  # the process's Prometheus metrics
    api_key: str | None = None


class _Front:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def _authorize(self, request: Request) -> None:
        key = self.backend.api_key
        if key is not None and not bearer_matches(request.headers.get("authorization"), key):
            raise HttpError(Code.UNAUTHENTICATED, "missing or wrong API key: send the header "
                            "'Authorization: Bearer <key>'", error_code="invalid_api_key")

    def _card(self, model: str | None) -> ModelCard:
        card = self.backend.model()
        if card is None:
            raise HttpError(Code.UNAVAILABLE, "no model is ready to serve yet")
        if model is not None and model != card.name:
            raise HttpError(Code.NOT_FOUND, f"model {quote(model)} does not exist; this server "
                            f"serves {card.name!r}", param="model", error_code="model_not_found")
        return card

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatRequest)

    async def _generate(self, request: Request,
                        kind: type[CompletionRequest] | type[ChatRequest]) -> Response:
        self._authorize(request)
        try:
            body = kind.model_validate_json(await _read_body(request))
        except ValidationError as e:
            raise _invalid(e) from None
        card = self._card(body.model)
        builder = ResponseBuilder(body, card.name, self.backend.tokenizer())
        try:
            requests = generate_requests(body, card, builder.id)
        except ValueError as e:
            raise HttpError(Code.INVALID_ARGUMENT, str(e)) from None
        choices = run_choices(self.backend.stream, requests)
        if not body.stream:
            outs = await _unless_disconnected(request, _collect(choices, len(requests)))
            return Response(status_code=499) if outs is None else JSONResponse(
                builder.response(outs))
        # The status line waits for the first chunk, so a refusal is still an HTTP error.
        first = await _unless_disconnected(request, anext(choices))
        if first is None:
            await choices.aclose()
            return Response(status_code=499)
        return _SseResponse(_sse(builder, len(requests), first, choices))

    async def models(self, request: Request) -> dict[str, Any]:
        self._authorize(request)
        card = self.backend.model()
        cards = [] if card is None else [card]
        return {"object": "list", "data": [
            {"id": c.name, "object": "model", "created": 0, "owned_by": "nanoserve",
             "root": c.name, "max_model_len": c.max_model_len} for c in cards]}

    async def model_info(self, request: Request) -> dict[str, Any]:
        """SGLang's /get_model_info, which its model gateway probes."""
        self._authorize(request)
        card = self._card(None)
        return {"model_path": card.name, "tokenizer_path": card.name, "is_generation": True,
                "max_model_len": card.max_model_len}

    async def server_info(self, request: Request) -> dict[str, Any]:
        """SGLang's /get_server_info: the model and its limits."""
        self._authorize(request)
        card = self._card(None)
        return {"served_model_name": card.name, "model_path": card.name,
                "context_length": card.max_model_len, "max_model_len": card.max_model_len,
                "vocab_size": card.vocab_size}

    async def health(self) -> Response:
        return Response(status_code=200 if self.backend.serving() else 503)

    async def metrics(self) -> Response:
        return Response(generate_latest(self.backend.registry), media_type=CONTENT_TYPE_LATEST)


def _invalid(error: ValidationError) -> HttpError:
    """A body pydantic refused, as a 400 naming the field (for a union, the types it takes)."""
    errors = error.errors(include_url=False)
    loc, message = errors[0]["loc"], errors[0]["msg"]
    if not loc:
        return HttpError(Code.INVALID_ARGUMENT, f"request could not be decoded: {message}")
    field = str(loc[0])
    kinds = list(dict.fromkeys(str(e["loc"][1]) for e in errors
                               if len(e["loc"]) > 1 and e["loc"][0] == loc[0]))
    if len(kinds) > 1:  # one error per member of the field's union
        message = f"{field} must be {' or '.join(kinds)}, got {quote(errors[0]['input'])}"
    else:
        message = f"{'.'.join(map(str, loc))}: {message}"
    return HttpError(Code.INVALID_ARGUMENT, message, param=field)


def build_app(backend: Backend) -> FastAPI:
    """The OpenAI endpoints plus /health, /metrics and SGLang's /get_model_info and
    /get_server_info; /health and /metrics need no API key."""
    app = FastAPI(title="nanoserve", docs_url=None, redoc_url=None, openapi_url=None)
    front = _Front(backend)
    app.add_api_route("/v1/completions", front.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", front.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", front.models, methods=["GET"])
    app.add_api_route("/get_model_info", front.model_info, methods=["GET"])
    app.add_api_route("/get_server_info", front.server_info, methods=["GET"])
    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/metrics", front.metrics, methods=["GET"])

    @app.exception_handler(HttpError)
    async def _http_error(request: Request, error: HttpError) -> JSONResponse:
        return error.response()

    return app


# ---- uvicorn on the running loop --------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """uvicorn without signal handlers of its own: the process owns SIGTERM (drain) and
    SIGINT, and stops this server itself."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    def __init__(self, server: _Uvicorn, task: asyncio.Task, port: int, scheme: str) -> None:
        self._server = server
        self._task = task
        self.port = port
        self.scheme = scheme

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting; responses in flight get `grace` seconds, then are cancelled."""
        # uvicorn reports a zero timeout as exceeded even with nothing in flight
        self._server.config.timeout_graceful_shutdown = max(grace, 0.05)
        self._server.should_exit = True
        await self._task


def bind_http(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: any free port). A port that is taken raises
    OSError naming it at once (SO_REUSEADDR for restarts, never SO_REUSEPORT)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        raise cannot_listen(f"{host}:{port} (HTTP)", e.strerror or e) from None


async def serve_http(app: FastAPI, sock: socket.socket, *, tls_cert: str | None = None,
                     tls_key: str | None = None, tls_ca: str | None = None) -> HttpServer:
    """Serve `app` on `sock` (bind_http) in the running loop; HTTPS with tls_cert/tls_key,
    requiring client certificates signed by tls_ca when it is given, reread on every new
    connection (tls.rotating_server_context)."""
    config = uvicorn.Config(app, log_config=None, log_level="warning", access_log=False,
                            lifespan="off")
    if tls_cert is not None:
        # uvicorn loads PEM paths once; its loaded config's context is what it serves with,
        # so put one there that follows the files (certificates rotate without a restart)
        config.load()
        try:
            config.ssl = rotating_server_context(tls_cert, tls_key, tls_ca)
        except OSError:  # files that do not load: the message names them
            sock.close()
            raise
    server = _Uvicorn(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="http-server")
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped it
            raise RuntimeError("the HTTP server stopped while starting")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, sock.getsockname()[1], "https" if tls_cert else "http")
