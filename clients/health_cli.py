"""`nanoserve health`: one grpc.health.v1 check of an engine or a router, for exec probes
(the kubelet's native gRPC probes cannot speak TLS). Prints the status; exit 0 only when
SERVING."""

from __future__ import annotations

import argparse
import sys

from clients.client import Client
from clients.errors import NanoserveError
from engine_service.common.tls import add_tls_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, metavar="HOST:PORT",
                        help="router or engine address")
    parser.add_argument("--service", default="",
                        help='health service name: "" = the whole server; the router also '
                             'answers "liveness" (SERVING while its process serves)')
    parser.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS")
    add_tls_arguments(parser)


def main(args: argparse.Namespace) -> int:
    try:
        with Client(args.target, timeout=args.timeout, tls_ca=args.tls_ca,
                    tls_cert=args.tls_cert, tls_key=args.tls_key) as client:
            status = client.health(args.service)
    except NanoserveError as e:
        print(f"error: {e.code.name}: {e.details}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(status)
    return 0 if status == "SERVING" else 1
