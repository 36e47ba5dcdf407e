"""The router's tokenizer: from --tokenizer DIR, or fetched once from an engine; loaded on
first use, so a router that only sees token-id prompts never loads it."""

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
FETCH_TIMEOUT_S = 30.0


class TokenizerUnavailable(RuntimeError):
    pass


class TokenizerSource:
    def __init__(self, tokenizer_dir: str | None) -> None:
        self._dir = tokenizer_dir
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
            files: dict[str, bytearray] = {}
            try:
                async for piece in engine.engine.GetTokenizer(
                        nanoserve_pb2.GetTokenizerRequest(), timeout=FETCH_TIMEOUT_S):
                    files.setdefault(piece.name, bytearray()).extend(piece.content)
                tokenizer = Tokenizer(files)
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
