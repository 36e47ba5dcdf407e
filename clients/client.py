"""Python clients for nanoserve's Generation and Engine services, sync and asyncio.

The same client talks to a router or to one engine: both serve `Generation`. Requests are
built in one place (`build_request`), from a prompt and SamplingParams keywords; for a
diffusion model (LLaDA, Dream), `diffusion=` a DiffusionParams or a dict of its fields, as
`SamplingParams(diffusion=...)` offline.
"""

from __future__ import annotations

import numbers
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.errors import from_rpc_error
from engine_service.common import proto_convert as pb_convert
from engine_service.common.api_key import key_metadata
from engine_service.common.proto_convert import (
    diffusion_params_to_proto,
    sampling_params_to_proto,
)
from engine_service.common.sampling_params import DiffusionParams, SamplingParams, check_field
from engine_service.common.tls import (
    ChannelOptions,
    channel_credentials,
    check_tls_files,
    open_channel,
)
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc

# text, token ids, or chat messages ({"role": ..., "content": ...} each)
Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
# How a diffusion model decodes: DiffusionParams, or some of its fields (the rest default)
Diffusion = DiffusionParams | Mapping[str, Any]


SAMPLING_FIELDS = pb_convert.SAMPLING_FIELDS
# Fields the engines check in SamplingParams; the client runs the same checks before sending.
_CHECKED_FIELDS: frozenset[str] = frozenset(f.name for f in fields(SamplingParams))


def build_request(prompt: Prompt, request_id: str | None = None, priority: int = 0,
                  diffusion: Diffusion | None = None, **sampling: Any) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt and SamplingParams field values (None = leave unset);
    `priority` (an int32, lower runs earlier on engines with --scheduling-policy priority);
    `diffusion` for an engine serving a diffusion model (checked here, ValueError naming
    the field, as its values need no model to check).

    `stop` may be one string. Raises TypeError for an unknown keyword or a prompt of the
    wrong shape, ValueError for an empty prompt list or a value the proto cannot hold
    (e.g. a negative max_tokens). Range checks are left to check_sampling, which Client and
    AsyncClient run first, and to the server, so a test can build an out-of-range request.
    """
    unknown = sorted(set(sampling) - SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(unknown)} "
                        f"(expected {', '.join(sorted(SAMPLING_FIELDS))})")
    check_field(isinstance(priority, int) and -2**31 <= priority < 2**31, "priority",
                "an int32", priority)
    request = pb.GenerateRequest(request_id=request_id or "", priority=priority,
                                 sampling=sampling_params_to_proto(sampling))
    if diffusion is not None:
        request.diffusion.CopyFrom(diffusion_params_to_proto(diffusion))
    _set_prompt(request, prompt)
    return request


def check_sampling(sampling: Mapping[str, Any]) -> None:
    """ValueError for a sampling value out of range: the engines' own check and message
    ("max_tokens must be >= 1, got -1"); what needs the model (prompt length, vocabulary)
    is left to the server."""
    SamplingParams(**{k: v for k, v in sampling.items() if k in _CHECKED_FIELDS and v is not None})


def _set_prompt(request: pb.GenerateRequest, prompt: Prompt) -> None:
    if isinstance(prompt, str):
        request.text = prompt
        return
    if isinstance(prompt, (bytes, bytearray, Mapping)) or not isinstance(prompt, Sequence):
        raise TypeError("prompt must be a str, a list of token ids or a list of "
                        f"{{'role', 'content'}} dicts, got {type(prompt).__name__}")
    items = list(prompt)
    if not items:
        raise ValueError("prompt must not be an empty list")
    if all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in items):
        try:
            request.token_ids.ids.extend(int(x) for x in items)
        except ValueError as e:
            raise ValueError(f"token ids must be in [0, 2**32): {e}") from None
    elif all(isinstance(x, Mapping) for x in items):
        for message in items:
            if set(message) != {"role", "content"}:
                raise TypeError("a chat message needs exactly the keys 'role' and 'content', "
                                f"got {sorted(message)}")
            request.messages.messages.add(role=message["role"], content=message["content"])
    else:
        raise TypeError("a list prompt must hold only ints (token ids) or only "
                        "{'role', 'content'} dicts (chat messages)")


def finish_reason_name(value: int) -> str | None:
    """FINISH_REASON_STOP -> "stop" (also "length", "abort"); UNSPECIFIED -> None."""
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    try:
        return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()
    except ValueError:  # a reason added to the proto after these stubs were generated
        return str(value)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    num_forward_passes: int = 0  # diffusion models: the passes the request took

    @classmethod
    def from_proto(cls, usage: pb.Usage) -> Usage:
        return cls(usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens,
                   usage.num_forward_passes)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    @classmethod
    def from_proto(cls, lp: pb.TokenLogprob) -> TokenLogprob:
        return cls(lp.token_id, lp.logprob, list(lp.top_token_ids), list(lp.top_logprobs))


@dataclass
class GenerateResult:
    """The whole answer of `generate`. finish_reason: "stop", "length" or "abort"."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str
    usage: Usage
    logprobs: list[TokenLogprob]
    engine_id: str

    @classmethod
    def from_proto(cls, r: pb.GenerateResponse) -> GenerateResult:
        return cls(r.request_id, r.text, list(r.token_ids), finish_reason_name(r.finish_reason),
                   r.stop_reason, Usage.from_proto(r.usage),
                   [TokenLogprob.from_proto(lp) for lp in r.logprobs], r.engine_id)


@dataclass
class Chunk:
    """One piece of a stream; finish_reason and usage are set on the last chunk only."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str
    usage: Usage | None
    logprobs: list[TokenLogprob]
    engine_id: str

    @classmethod
    def from_proto(cls, c: pb.GenerateChunk) -> Chunk:
        usage = Usage.from_proto(c.usage) if c.HasField("usage") else None
        return cls(c.request_id, list(c.token_ids), c.text, finish_reason_name(c.finish_reason),
                   c.stop_reason, usage, [TokenLogprob.from_proto(lp) for lp in c.logprobs],
                   c.engine_id)


def _credentials(tls_ca: str | None, tls_cert: str | None,
                 tls_key: str | None) -> grpc.ChannelCredentials | None:
    check_tls_files(tls_cert, tls_key, tls_ca, ca_alone=True)
    if tls_cert is not None and tls_ca is None:  # a certificate is shown over TLS only
        raise ValueError("--tls-cert needs --tls-ca (the CA that verifies the server)")
    return channel_credentials(tls_ca, tls_cert, tls_key)


def _prepare(prompt: Prompt, kwargs: dict[str, Any],
             default_timeout: float | None) -> tuple[pb.GenerateRequest, float | None]:
    """Split call keywords from sampling keywords; timeout None falls back to the client's."""
    timeout = kwargs.pop("timeout", None)
    timeout = default_timeout if timeout is None else timeout
    request_id, priority = kwargs.pop("request_id", None), kwargs.pop("priority", 0)
    diffusion = kwargs.pop("diffusion", None)
    check_sampling(kwargs)  # before anything is sent, in the engines' words
    return build_request(prompt, request_id, priority, diffusion, **kwargs), timeout


class Client:
    """Blocking client: `Client("host:port").generate(prompt, max_tokens=32)`.

    `timeout` is the default deadline in seconds for every call (None: no deadline); a call
    may set its own with `timeout=` (None there means the client's default).
    `wait_for_ready` makes calls wait for the target to come up (within the deadline)
    instead of failing fast with Unavailable. `tls_ca` (a PEM file) connects over TLS and
    verifies the server against that CA; `tls_cert` and `tls_key` add a client certificate
    for servers that require one (mTLS). Without `tls_ca` the channel is plaintext.
    `api_key` is sent as `authorization: Bearer KEY` on every call (servers run with
    --api-key require it).
    """

    def __init__(self, target: str, timeout: float | None = None, *,
                 wait_for_ready: bool = False, options: ChannelOptions = (),
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, api_key: str | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self.wait_for_ready = wait_for_ready
        self._metadata = key_metadata(api_key)
        self._channel = open_channel(target, _credentials(tls_ca, tls_cert, tls_key), options)
        self._generation = pb_grpc.GenerationStub(self._channel)
        self._engine = pb_grpc.EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, prompt: Prompt, **kwargs: Any) -> GenerateResult:
        request, timeout = _prepare(prompt, kwargs, self.timeout)
        response = self._unary(self._generation.Generate, request, timeout)
        return GenerateResult.from_proto(response)

    def stream(self, prompt: Prompt, **kwargs: Any) -> Iterator[Chunk]:
        """Chunks as the server produces them. Closing the iterator early (close(), break
        then drop it, garbage collection) cancels the RPC so the server frees the request."""
        request, timeout = _prepare(prompt, kwargs, self.timeout)  # bad keywords raise here
        return self._stream(request, timeout)

    def _stream(self, request: pb.GenerateRequest, timeout: float | None) -> Iterator[Chunk]:
        call = self._generation.Stream(request, timeout=timeout, metadata=self._metadata,
                                       wait_for_ready=self.wait_for_ready)
        try:
            for message in call:
                yield Chunk.from_proto(message)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        finally:
            call.cancel()  # no-op once the stream has ended; frees the server otherwise

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self._unary(self._engine.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    def load(self, timeout: float | None = None) -> pb.Load:
        return self._unary(self._engine.GetLoad, pb.GetLoadRequest(), timeout)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The grpc.health.v1 status name of `service` ("" = the whole server): "SERVING", ..."""
        response = self._unary(self._health.Check,
                               health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        timeout = self.timeout if timeout is None else timeout
        try:
            return method(request, timeout=timeout, metadata=self._metadata,
                          wait_for_ready=self.wait_for_ready)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client with Client's API and keywords (TLS, api_key): `await generate(...)`,
    `async for c in stream(...)`.

    The channel is opened on first use, inside the running event loop (grpc.aio channels
    belong to one loop). Use `async with AsyncClient(...)` or `await close()`.
    """

    def __init__(self, target: str, timeout: float | None = None, *,
                 wait_for_ready: bool = False, options: ChannelOptions = (),
                 tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, api_key: str | None = None) -> None:
        self.target = target
        self.timeout = timeout
        self.wait_for_ready = wait_for_ready
        self._metadata = key_metadata(api_key)
        self._options = list(options)
        self._credentials = _credentials(tls_ca, tls_cert, tls_key)
        self._channel: grpc.aio.Channel | None = None

    def _get_channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = open_channel(self.target, self._credentials, self._options, aio=True)
        return self._channel

    async def generate(self, prompt: Prompt, **kwargs: Any) -> GenerateResult:
        request, timeout = _prepare(prompt, kwargs, self.timeout)
        stub = pb_grpc.GenerationStub(self._get_channel())
        return GenerateResult.from_proto(await self._unary(stub.Generate, request, timeout))

    def stream(self, prompt: Prompt, **kwargs: Any) -> AsyncIterator[Chunk]:
        """Async iterator of chunks; `aclose()` (or garbage collection) cancels the RPC."""
        request, timeout = _prepare(prompt, kwargs, self.timeout)
        return self._stream(request, timeout)

    async def _stream(self, request: pb.GenerateRequest,
                      timeout: float | None) -> AsyncIterator[Chunk]:
        stub = pb_grpc.GenerationStub(self._get_channel())
        call = stub.Stream(request, timeout=timeout, metadata=self._metadata,
                           wait_for_ready=self.wait_for_ready)
        try:
            async for message in call:
                yield Chunk.from_proto(message)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e
        finally:
            call.cancel()

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        stub = pb_grpc.EngineStub(self._get_channel())
        return await self._unary(stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    async def load(self, timeout: float | None = None) -> pb.Load:
        stub = pb_grpc.EngineStub(self._get_channel())
        return await self._unary(stub.GetLoad, pb.GetLoadRequest(), timeout)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        stub = health_pb2_grpc.HealthStub(self._get_channel())
        response = await self._unary(stub.Check,
                                     health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        timeout = self.timeout if timeout is None else timeout
        try:
            return await method(request, timeout=timeout, metadata=self._metadata,
                                wait_for_ready=self.wait_for_ready)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
