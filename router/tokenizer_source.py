"""The router's tokenizer: from --tokenizer DIR, or fetched once from an engine.

engine_service.common.tokenizer is torch-free; it is imported on first use so that a router that
only ever sees token-id prompts never loads it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from nanoserve.v1 import nanoserve_pb2

if TYPE_CHECKING:
    from engine_service.common.tokenizer import Tokenizer
    from router.engine_pool import EnginePool

log = logging.getLogger("nanoserve.router")


class TokenizerUnavailable(RuntimeError):
    pass


async def fetch_tokenizer_files(stub, timeout: float) -> dict[str, bytes]:
    """Collect GetTokenizer's stream into {file name: bytes}."""
    files: dict[str, bytearray] = {}
    call = stub.GetTokenizer(nanoserve_pb2.GetTokenizerRequest(), timeout=timeout)
    async for piece in call:
        files.setdefault(piece.name, bytearray()).extend(piece.content)
    return {name: bytes(data) for name, data in files.items()}


class TokenizerSource:
    def __init__(self, tokenizer_dir: str | None, fetch_timeout: float = 30.0) -> None:
        self._dir = tokenizer_dir
        self._fetch_timeout = fetch_timeout
        self._tokenizer: Tokenizer | None = None
        self._lock = asyncio.Lock()

    @property
    def loaded(self) -> Tokenizer | None:
        return self._tokenizer

    def load_dir(self) -> None:
        """Load --tokenizer DIR now (at startup, so a bad directory fails early)."""
        if self._dir is not None and self._tokenizer is None:
            from engine_service.common.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_dir(self._dir)

    async def get(self, pool: EnginePool) -> Tokenizer:
        if self._tokenizer is not None:
            return self._tokenizer
        async with self._lock:
            if self._tokenizer is None:
                if self._dir is not None:
                    self.load_dir()
                else:
                    self._tokenizer = await self._fetch(pool)
        assert self._tokenizer is not None
        return self._tokenizer

    async def _fetch(self, pool: EnginePool) -> Tokenizer:
        from engine_service.common.tokenizer import Tokenizer

        errors = []
        for engine in pool.routable() or pool.engines():
            try:
                files = await fetch_tokenizer_files(engine.engine, self._fetch_timeout)
                tokenizer = Tokenizer.from_files(files)
            except grpc.aio.AioRpcError as e:
                errors.append(f"{engine.key}: {e.code().name} {e.details()}")
                continue
            except (ValueError, OSError, KeyError) as e:
                errors.append(f"{engine.key}: bad tokenizer files ({e})")
                continue
            log.info("tokenizer fetched from engine %s (%s)", engine.key, ", ".join(sorted(files)))
            return tokenizer
        detail = "; ".join(errors) if errors else "no engine known"
        raise TokenizerUnavailable(
            f"the router has no tokenizer (no --tokenizer DIR and no engine gave one: {detail})")
