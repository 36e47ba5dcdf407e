"""Listening on a port: a port that is taken fails at once, with a message naming the
address, in every server of the router and the engines (gRPC and /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


def cannot_listen(address: str, why: object) -> OSError:
    return OSError(f"cannot listen on {address}: {why} (is another server using the port?)")


def serve_metrics(registry: CollectorRegistry, host: str, port: int):
    """Serve Prometheus /metrics on host:port from a thread; returns the server (call
    .shutdown()). OSError naming the address when it cannot listen."""
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise cannot_listen(f"{host}:{port} (metrics)", e.strerror or e) from None
    return server
