"""Typed errors for nanoserve clients: one exception class per gRPC status a caller acts on.

Servers answer with plain gRPC status codes (see the .proto header); these classes let a
caller write `except ResourceExhausted:` instead of comparing `err.code()` by hand.
"""

from __future__ import annotations

import grpc


class NanoserveError(Exception):
    """A failed nanoserve call. `.code` is the grpc.StatusCode, `.details` the server's text."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.details = message


class InvalidArgument(NanoserveError):
    """A parameter is out of range or the prompt is too long; details name the field."""


class ResourceExhausted(NanoserveError):
    """The engine's queue is full; retry later."""


class Unavailable(NanoserveError):
    """Nothing listens at the target, the engine is draining, or no engine can take it."""


class DeadlineExceeded(NanoserveError):
    """The call's deadline (`timeout`) passed before the answer was complete."""


class Cancelled(NanoserveError):
    """The call was cancelled (by the caller or the server)."""


_BY_CODE: dict[grpc.StatusCode, type[NanoserveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def from_rpc_error(err: grpc.RpcError) -> NanoserveError:
    """The typed exception for a grpc.RpcError (sync or aio); other codes give the base class."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    code = code or grpc.StatusCode.UNKNOWN
    return _BY_CODE.get(code, NanoserveError)(code, details or "")
