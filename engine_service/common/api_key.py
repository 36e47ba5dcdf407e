"""--api-key: every call must carry `Bearer KEY` (HTTP header `Authorization`, gRPC metadata
`authorization`). Health checks stay open, as vLLM leaves /health open: probes (kubelet's
gRPC probe, `nanoserve health`) send no credentials."""

from __future__ import annotations

import hmac
from collections.abc import Iterable

import grpc

HEADER = "authorization"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
GRPC_REFUSAL = f"missing or wrong API key: send metadata '{HEADER}: Bearer <key>'"


def key_metadata(key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client with `key` sends (none without a key)."""
    return () if key is None else ((HEADER, f"Bearer {key}"),)


def bearer_matches(value: str | None, key: str) -> bool:
    """Whether an Authorization value is `Bearer key` (scheme case-insensitive, as HTTP
    has it); compared in constant time."""
    scheme, _, token = (value or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              key.encode())


def _authorization(metadata: Iterable[tuple[str, str]] | None) -> str | None:
    return next((value for name, value in metadata or () if name == HEADER), None)


async def _deny_unary(request, context: grpc.aio.ServicerContext) -> None:
    context.set_code(grpc.StatusCode.UNAUTHENTICATED)
    context.set_details(GRPC_REFUSAL)


async def _deny_stream(request, context: grpc.aio.ServicerContext):
    await _deny_unary(request, context)
    return
    yield  # an async generator, as a response-streaming handler must be


_MAKERS = {(False, False): grpc.unary_unary_rpc_method_handler,
           (False, True): grpc.unary_stream_rpc_method_handler,
           (True, False): grpc.stream_unary_rpc_method_handler,
           (True, True): grpc.stream_stream_rpc_method_handler}


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls without `authorization: Bearer KEY`; put it first, so a
    refused request is never parsed."""

    def __init__(self, key: str) -> None:
        self._key = key

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_PREFIXES) \
                or bearer_matches(_authorization(handler_call_details.invocation_metadata),
                                  self._key):
            return handler
        make = _MAKERS[(handler.request_streaming, handler.response_streaming)]
        return make(_deny_stream if handler.response_streaming else _deny_unary,
                    response_serializer=handler.response_serializer)


def api_key_interceptors(key: str | None) -> list[grpc.aio.ServerInterceptor]:
    """The server interceptors --api-key adds, to go before all others."""
    return [] if key is None else [ApiKeyInterceptor(key)]


class _AddKey:
    def __init__(self, key: str) -> None:
        self._metadata = key_metadata(key)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return details._replace(metadata=metadata)


class _UnaryUnaryKey(_AddKey, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _UnaryStreamKey(_AddKey, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def key_channel_interceptors(key: str | None) -> list[grpc.aio.ClientInterceptor]:
    """grpc.aio channel interceptors that add `authorization: Bearer KEY` to every call (the
    router's calls to engines that require a key). One per call kind: a channel files an
    interceptor under the first kind it is an instance of."""
    return [] if key is None else [_UnaryUnaryKey(key), _UnaryStreamKey(key)]
