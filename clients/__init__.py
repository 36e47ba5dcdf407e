"""nanoserve clients: `Client` (blocking) and `AsyncClient` (asyncio) for routers and engines.

Torch-free: the router and client machines import this package without torch.
"""

from clients.client import (
    AsyncClient,
    Chunk,
    Client,
    GenerateResult,
    TokenLogprob,
    Usage,
    build_request,
)
from clients.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    NanoserveError,
    ResourceExhausted,
    Unavailable,
)

__all__ = [
    "AsyncClient", "Cancelled", "Chunk", "Client", "DeadlineExceeded", "GenerateResult",
    "InvalidArgument", "NanoserveError", "ResourceExhausted", "TokenLogprob", "Unavailable",
    "Usage", "build_request",
]
