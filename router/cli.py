"""`nanoserve router`: flags and the serving loop. Torch-free at import (and at run)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from engine_service.common.serving_flags import add_serving_arguments, dataclass_from_args
from engine_service.common.tls import add_tls_arguments
from router.config import RouterConfig
from router.policy import POLICIES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig  # dataclass field defaults, so help and config cannot disagree
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    where = parser.add_argument_group("engines (give --engine or --engine-dns)")
    where.add_argument("--engine", action="append", default=[], metavar="HOST:PORT",
                       help="an engine service; repeat for more")
    where.add_argument("--engine-dns", default=None, metavar="NAME:PORT",
                       help="a DNS name (e.g. a Kubernetes headless Service) whose addresses "
                            "are the engines; re-resolved every --dns-interval seconds")
    where.add_argument("--dns-interval", type=float, default=d.dns_interval, metavar="S",
                       help="seconds between DNS resolutions of --engine-dns")
    parser.add_argument("--host", default=d.host, help="address to listen on (also metrics)")
    parser.add_argument("--port", type=int, default=d.port, help="gRPC port (0 = any free)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="Prometheus /metrics port; None or 0 = off")
    parser.add_argument("--policy", choices=POLICIES, default=d.policy,
                        help="prefix: cost = uncached prompt tokens x --cache-weight + engine "
                             "load (tokens in flight), lowest wins; least-load; round-robin")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="tokenizer directory; None = fetch it from an engine (GetTokenizer)")
    parser.add_argument("--cache-weight", type=float, default=d.cache_weight, metavar="W",
                        help="weight of an uncached prompt token against a token in flight")
    parser.add_argument("--load-guard-ratio", type=float, default=d.load_guard_ratio,
                        metavar="R",
                        help="send to the least-loaded engine when the cost winner's load is "
                             "above R x the least load and above it by --load-guard-min "
                             "(0 = guard off)")
    parser.add_argument("--load-guard-min", type=float, default=d.load_guard_min,
                        metavar="TOKENS", help="smallest load gap (tokens) the guard acts on")
    parser.add_argument("--health-interval", type=float, default=d.health_interval,
                        metavar="S", help="seconds between engine health checks")
    parser.add_argument("--load-interval", type=float, default=d.load_interval, metavar="S",
                        help="seconds between GetLoad polls of each engine")
    parser.add_argument("--optimistic-ttl", type=float, default=d.optimistic_ttl, metavar="S",
                        help="seconds a routed prompt counts as cached on its engine before "
                             "that engine's KV events confirm it")
    parser.add_argument("--max-attempts", type=int, default=d.max_attempts, metavar="N",
                        help="engines tried per request (retries and mid-stream failovers)")
    parser.add_argument("--failure-backoff", type=float, default=d.failure_backoff,
                        metavar="S", help="an engine that fails is skipped this long, doubling "
                                          "per consecutive failure")
    parser.add_argument("--failure-backoff-max", type=float, default=d.failure_backoff_max,
                        metavar="S", help="cap of that backoff")
    parser.add_argument("--stream-progress-timeout", type=float,
                        default=d.stream_progress_timeout, metavar="S",
                        help="an engine that sent a request's first chunk and then no chunk for "
                             "this long (measured from its last chunk, checked every "
                             "--health-interval) counts as failed, and the request continues on "
                             "another engine. The wait for a first chunk (queueing, prefill) is "
                             "not timed; an engine that hangs then turns NOT_SERVING (its core "
                             "watchdog), and a NOT_SERVING engine's calls silent for a "
                             "--health-interval move too")
    parser.add_argument("--max-concurrent-requests", type=int,
                        default=d.max_concurrent_requests, metavar="N",
                        help="requests in flight through the router at most (0 = unlimited); "
                             "more wait in a FIFO queue")
    parser.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                        metavar="M", help="requests waiting for a --max-concurrent-requests "
                                          "slot at most; beyond: RESOURCE_EXHAUSTED at once")
    parser.add_argument("--queue-timeout", type=float, default=d.queue_timeout, metavar="S",
                        help="a queued request that gets no slot within this is "
                             "RESOURCE_EXHAUSTED (with a retry-after hint)")
    parser.add_argument("--log-level", default=d.log_level, type=str.lower,
                        choices=("debug", "info", "warning", "error"),
                        help="debug logs every routing decision")
    add_serving_arguments(parser, http_port=d.http_port,
                          model_name_help="None: the engines' model name (GetModelInfo)",
                          api_key_help="; the router sends it to the engines too")
    add_tls_arguments(parser, cert_help="serve TLS (gRPC and HTTP) with this certificate "
                      "chain; also the client certificate shown to engines that require one. "
                      "The files are reread when they change (rotation needs no restart)",
                      ca_help="connect to engines over TLS, verifying them against this CA")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return dataclass_from_args(RouterConfig, args)


async def serve(config: RouterConfig) -> None:
    from router.server import Router  # grpc server machinery only when serving

    router = Router(config)
    await router.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(router.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    await router.stop(grace=5.0)
    waiter.cancel()


def main(args: argparse.Namespace) -> int:
    level = args.log_level.upper()
    # debug is for the router's own lines (one per routing decision), not grpc's internals
    logging.basicConfig(level="INFO" if level == "DEBUG" else level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("nanoserve").setLevel(level)
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"nanoserve router: error: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except OSError as e:
        print(f"nanoserve router: error: {e}", file=sys.stderr)
        return 1
    return 0

