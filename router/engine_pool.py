"""The engines behind the router: discovery, health, load, KV-event subscriptions, passive
failure detection and stalled calls (docs/architecture.md, "Router": engine_pool.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.common.api_key import key_channel_interceptors
from engine_service.common.block_hash import HASH_SCHEME
from engine_service.common.sampling_params import DIFFUSION_ARCHITECTURES
from engine_service.common.tls import PemFiles, channel_credentials, open_channel
from nanoserve.v1 import nanoserve_pb2, nanoserve_pb2_grpc
from router.config import RouterConfig, split_host_port
from router.metrics import RouterMetrics
from router.prefix_index import ApplyResult, PrefixIndex

log = logging.getLogger("nanoserve.router")

Resolver = Callable[[str], Awaitable[list[str]]]

_KV_RECONNECT_MIN_S = 0.05
_KV_RECONNECT_MAX_S = 2.0


async def resolve_dns(name_port: str) -> list[str]:
    """NAME:PORT -> sorted HOST:PORT of every address it resolves to (IPv6 in brackets)."""
    host, port = split_host_port(name_port)
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = set()
    for family, _type, _proto, _name, sockaddr in infos:
        ip = sockaddr[0]
        addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(addresses)


@dataclass
class _Watched:
    """The router's call to this engine for one request."""

    call: grpc.aio.Call
    waiting_since: float | None  # for the next chunk; None while the client takes one
    had_chunk: bool = False
    abandoned: str | None = None  # why the router cancelled it


@contextlib.contextmanager
def _log_unexpected(key: str, what: str):
    """Keep an engine's background loop alive through a bug in one iteration."""
    try:
        yield
    except Exception:
        log.exception("engine %s: %s failed unexpectedly", key, what)


class EngineClient:
    def __init__(self, address: str, config: RouterConfig, index: PrefixIndex,
                 metrics: RouterMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.key = address
        self.config = config
        self.index = index
        self.metrics = metrics
        self._clock = clock
        # gRPC backs reconnects off up to 120 s, so an engine restarted on its address
        # after a long outage would wait that long to rejoin; cap it near the health loop.
        backoff_ms = max(1000, int(config.health_interval * 1000))
        options = [("grpc.max_reconnect_backoff_ms", backoff_ms)]
        if config.engine_dns and config.tls_ca:
            # DNS discovery dials pod IPs; the engines' certificate names the DNS name.
            options.append(("grpc.ssl_target_name_override",
                            split_host_port(config.engine_dns)[0]))
        self._options = options
        self._tls = (PemFiles(config.tls_ca, config.tls_cert, config.tls_key)
                     if config.tls_ca else None)
        self._open_channel()
        self.info: nanoserve_pb2.ModelInfo | None = None
        self.problem: str | None = None          # set when the router cannot use this engine
        self.serving = False
        self._serving_event = asyncio.Event()  # KV subscriptions wait for a serving engine
        self.accepting = True
        self.reported_load = 0                    # Load.tokens_in_flight, last report
        # handle -> (tokens, when its first chunk arrived or None before that)
        self._pending: dict[int, tuple[int, float | None]] = {}
        self._handles = itertools.count()
        self.failures = 0                         # consecutive counted failures
        self.down_until = 0.0
        self._counted = 0                         # failures counted since start
        self._sent_after: dict[int, int] = {}     # handle -> _counted when it was sent
        self._watched: dict[int, _Watched] = {}
        self._tasks: list[asyncio.Task] = []
        self._kv_call: grpc.aio.Call | None = None  # the latest KV event subscription

    def _open_channel(self) -> None:
        """The channel and its stubs, with the TLS files as they are now."""
        if self._tls is not None:
            self._tls.take()  # before the credentials read them: a later change shows
        config = self.config
        self.channel = open_channel(
            self.key, channel_credentials(config.tls_ca, config.tls_cert, config.tls_key),
            self._options, aio=True,  # the router's --api-key goes to the engines too
            interceptors=key_channel_interceptors(config.api_key))
        self.generation = nanoserve_pb2_grpc.GenerationStub(self.channel)
        self.engine = nanoserve_pb2_grpc.EngineStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def _reopen_if_rotated(self) -> None:
        """A channel reconnects with the TLS files it was made with (grpcio has no reloading
        channel credentials), so once it cannot connect and the files changed (a rotated CA
        or client certificate) make a new one. Not while streams still run on the old one
        (a draining engine's): closing it would cancel them; a later check does it."""
        streaming = bool(self._sent_after) or (self._kv_call is not None
                                               and not self._kv_call.done())
        if self._tls is None or streaming or not self._tls.changed():
            return
        old = self.channel
        self._open_channel()
        log.info("engine %s: TLS files changed, new channel", self.key)
        # a load poll may still wait on the old channel: its timeout is the grace
        await old.close(grace=max(self.config.load_interval * 5, 1.0))

    @property
    def engine_id(self) -> str:
        return self.info.engine_id if self.info is not None and self.info.engine_id else self.key

    @property
    def is_diffusion(self) -> bool:
        """Serves a diffusion model (LLaDA, Dream), known from its model info."""
        return self.info is not None and self.info.architecture in DIFFUSION_ARCHITECTURES

    @property
    def block_size(self) -> int:
        assert self.info is not None
        return self.info.kv_block_size

    def start(self) -> None:
        self._tasks = [asyncio.create_task(loop(), name=f"{loop.__name__}:{self.key}")
                       for loop in (self._health_loop, self._load_loop, self._kv_loop)]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.channel.close()

    # ---- state ------------------------------------------------------------------------

    def routable(self) -> bool:
        return (self.info is not None and self.problem is None and self.serving
                and self.accepting and self._clock() >= self.down_until)

    def state(self) -> str:
        """Why this engine can or cannot take requests, for error messages."""
        if self.problem is not None:
            return self.problem
        if not self.serving:
            return "failing health checks"
        if self.info is None:
            return "model info not read yet"
        if not self.accepting:
            return "not accepting requests (draining)"
        if self._clock() < self.down_until:
            return f"backing off after {self.failures} failure(s)"
        return "ok"

    def load(self) -> float:
        """Tokens in flight: the engine's last report plus what was sent since."""
        return self.reported_load + sum(tokens for tokens, _ in self._pending.values())

    def begin_request(self, tokens: int) -> int:
        handle = next(self._handles)
        self._pending[handle] = (tokens, None)
        self._sent_after[handle] = self._counted
        return handle

    def watch(self, handle: int, call: grpc.aio.Call) -> None:
        """The request's call, cancelled when it stalls (`_abandon_stalled`)."""
        self._watched[handle] = _Watched(call, self._clock())

    def chunk_arrived(self, handle: int) -> None:
        """The engine's own figures count the request from its first chunk; the stall clock
        stops while the client takes the chunk."""
        entry = self._pending.get(handle)
        if entry is not None and entry[1] is None:
            self._pending[handle] = (entry[0], self._clock())
        watched = self._watched.get(handle)
        if watched is not None:
            watched.waiting_since, watched.had_chunk = None, True

    def awaiting_chunk(self, handle: int) -> None:
        watched = self._watched.get(handle)
        if watched is not None:
            watched.waiting_since = self._clock()

    def abandoned(self, handle: int) -> str | None:
        """Why the router cancelled the request's call (None: it did not)."""
        watched = self._watched.get(handle)
        return None if watched is None else watched.abandoned

    def end_request(self, handle: int) -> None:
        self._pending.pop(handle, None)
        self._sent_after.pop(handle, None)
        self._watched.pop(handle, None)

    def record_failure(self, code: grpc.StatusCode, handle: int | None = None) -> None:
        """Count a failure of the request `handle` (None: of no request in particular)."""
        if handle is not None and self._sent_after.get(handle, self._counted) < self._counted:
            log.debug("engine %s failed (%s) for a request sent before its last counted "
                      "failure: the same outage, not counted again", self.key, code.name)
            return
        self._counted += 1
        self.failures += 1
        backoff = min(self.config.failure_backoff * 2 ** (self.failures - 1),
                      self.config.failure_backoff_max)
        self.down_until = self._clock() + backoff
        self.metrics.engine_failures.labels(self.key, code.name).inc()
        self.metrics.engine_healthy.labels(self.key).set(0)
        log.warning("engine %s failed (%s, %d in a row): out of rotation for %.1fs",
                    self.key, code.name, self.failures, backoff)

    def record_success(self) -> None:
        if self.failures:
            log.info("engine %s recovered", self.key)
        self.failures = 0
        self.down_until = 0.0

    def _update_health_gauge(self) -> None:
        self.metrics.engine_healthy.labels(self.key).set(1 if self.routable() else 0)

    # ---- loops ------------------------------------------------------------------------

    async def check_health(self) -> None:
        timeout = max(self.config.health_interval, 0.5)
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError as e:
            log.debug("engine %s health check failed: %s", self.key, e.code().name)
            serving = False
            if e.code() == grpc.StatusCode.UNAVAILABLE:  # no connection, a failed handshake
                await self._reopen_if_rotated()
        if serving and not self.serving:
            serving = await self._read_model_info(timeout)
            if serving:
                # The last load report predates the outage (load polls stop while an engine
                # is not serving): a restarted process has nothing in flight, and a stale
                # figure would keep requests off it until the next poll.
                self.reported_load = 0
                log.info("engine %s (%s) is serving", self.key, self.engine_id)
                # Back from an outage the health checks saw: the backoff that the outage's
                # failures earned would only keep a working engine idle.
                self.record_success()
        elif self.serving and not serving:
            log.warning("engine %s stopped serving", self.key)
        self.serving = serving
        if serving:
            self._serving_event.set()
        else:
            self._serving_event.clear()
        self._update_health_gauge()
        self._abandon_stalled()

    def _abandon_stalled(self) -> None:
        now, moved = self._clock(), 0
        for watched in self._watched.values():
            if watched.waiting_since is None or watched.abandoned:
                continue
            waited = now - watched.waiting_since
            if not self.serving and waited >= self.config.health_interval:
                watched.abandoned = f"engine {self.key} stopped serving"
            elif watched.had_chunk and waited >= self.config.stream_progress_timeout:
                watched.abandoned = (f"engine {self.key} sent no chunk for {waited:.1f} s "
                                     "(--stream-progress-timeout)")
            else:
                continue
            watched.call.cancel()  # its reader sees CancelledError on its next await
            moved += 1
        if moved:
            log.warning("engine %s: %d stalled stream(s) move to other engines", self.key, moved)

    async def _read_model_info(self, timeout: float) -> bool:
        try:
            info = await self.engine.GetModelInfo(nanoserve_pb2.GetModelInfoRequest(),
                                                  timeout=timeout)
        except grpc.aio.AioRpcError as e:
            log.warning("engine %s: GetModelInfo failed: %s", self.key, e.code().name)
            return False
        self.info = info
        self.problem = None
        if info.hash_scheme != HASH_SCHEME:
            self.problem = (f"hash scheme {info.hash_scheme!r} differs from the router's "
                            f"{HASH_SCHEME!r}")
        elif info.kv_block_size < 1:
            self.problem = "reports kv_block_size 0"
        elif info.max_model_len < 2:  # no room for a prompt and one output token
            self.problem = f"reports max_model_len {info.max_model_len}"
        if self.problem:
            log.error("engine %s not used: %s", self.key, self.problem)
        return True

    async def _health_loop(self) -> None:
        while True:
            with _log_unexpected(self.key, "health check"):
                await self.check_health()
            await asyncio.sleep(self.config.health_interval)

    async def poll_load(self) -> None:
        """A sent request stops counting on top of the report once a report asked for after
        its first chunk arrives: the engine counts it only from the step that made that chunk."""
        asked_at = self._clock()
        try:
            load = await self.engine.GetLoad(nanoserve_pb2.GetLoadRequest(),
                                             timeout=max(self.config.load_interval * 5, 1.0))
        except grpc.aio.AioRpcError:
            return  # the health loop decides about the engine
        self.reported_load = load.tokens_in_flight
        self.accepting = load.accepting
        for handle, (_, started_at) in list(self._pending.items()):
            if started_at is not None and started_at < asked_at:
                del self._pending[handle]
        self.metrics.engine_load.labels(self.key).set(load.tokens_in_flight)

    async def _load_loop(self) -> None:
        while True:
            with _log_unexpected(self.key, "load poll"):
                if self.serving:
                    await self.poll_load()
                self._update_health_gauge()
            await asyncio.sleep(self.config.load_interval)

    async def _kv_loop(self) -> None:
        delay = _KV_RECONNECT_MIN_S
        while True:
            await self._serving_event.wait()
            resubscribe_now = False
            with _log_unexpected(self.key, "KV event stream"):
                resubscribe_now = await self._follow_kv_events()
            if resubscribe_now:
                delay = _KV_RECONNECT_MIN_S
                continue
            await asyncio.sleep(delay)
            delay = min(delay * 2, _KV_RECONNECT_MAX_S)

    async def _follow_kv_events(self) -> bool:
        """One subscription; True when it ended on a gap (re-subscribe for a snapshot)."""
        after = self.index.resume_point(self.key)
        call = self._kv_call = self.engine.SubscribeKvEvents(
            nanoserve_pb2.SubscribeKvEventsRequest(after_sequence_number=after))
        try:
            async for batch in call:
                if (self.info is not None and batch.kv_block_size
                        and batch.kv_block_size != self.info.kv_block_size):
                    log.warning("engine %s: KV events in blocks of %d, model info says %d",
                                self.key, batch.kv_block_size, self.info.kv_block_size)
                result = self.index.apply_batch(
                    self.key, batch.sequence_number, batch.snapshot,
                    batch.block_hashes_stored, batch.block_hashes_removed)
                if batch.snapshot:
                    log.info("engine %s: KV snapshot of %d cached block(s) at sequence %d",
                             self.key, len(batch.block_hashes_stored), batch.sequence_number)
                if result is not ApplyResult.APPLIED:
                    log.info("engine %s: KV events %s at sequence %d; re-snapshotting",
                             self.key, result.value, batch.sequence_number)
                    self.index.reset(self.key)
                    return True
        except grpc.aio.AioRpcError as e:
            log.debug("engine %s: KV event stream ended: %s", self.key, e.code().name)
        finally:
            call.cancel()
        return False


class EnginePool:
    """Every known engine, from a static list or a periodically re-resolved DNS name."""

    def __init__(self, config: RouterConfig, index: PrefixIndex, metrics: RouterMetrics,
                 resolver: Resolver = resolve_dns) -> None:
        self.config = config
        self.index = index
        self.metrics = metrics
        self._resolver = resolver
        self._engines: dict[str, EngineClient] = {}
        self._dns_task: asyncio.Task | None = None
        self._closing: set[asyncio.Task] = set()  # engines that left, closing

    async def start(self) -> None:
        if self.config.engine:
            self.set_addresses(self.config.engine)
        else:
            await self._resolve_once()
            self._dns_task = asyncio.create_task(self._dns_loop(), name="dns")

    async def close(self) -> None:
        if self._dns_task is not None:
            self._dns_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dns_task
        await asyncio.gather(*(e.close() for e in self._engines.values()), *self._closing)
        self._engines.clear()

    def set_addresses(self, addresses: Iterable[str]) -> None:
        """Make the pool hold exactly these engines (new ones join, missing ones leave)."""
        wanted = set(addresses)
        for key in sorted(set(self._engines) - wanted):
            client = self._engines.pop(key)
            log.info("engine %s left the pool", key)
            self.index.remove_engine(key)
            self.metrics.forget_engine(key)
            task = asyncio.create_task(client.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        for key in sorted(wanted - set(self._engines)):
            log.info("engine %s joined the pool", key)
            client = EngineClient(key, self.config, self.index, self.metrics)
            self._engines[key] = client
            client.start()

    async def _resolve_once(self) -> None:
        assert self.config.engine_dns is not None
        try:
            addresses = await self._resolver(self.config.engine_dns)
        except (OSError, ValueError) as e:
            log.warning("cannot resolve %s (%s); keeping %d engine(s)", self.config.engine_dns,
                        e, len(self._engines))
            return
        self.set_addresses(addresses)

    async def _dns_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.dns_interval)
            await self._resolve_once()

    def engines(self) -> list[EngineClient]:
        return list(self._engines.values())

    def routable(self) -> list[EngineClient]:
        return [e for e in self._engines.values() if e.routable()]
