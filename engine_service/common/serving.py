"""What the engine and router servers share around their Generation service: gRPC health
(and reflection) and the OpenAI HTTP front."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from engine_service.common.http_server import Backend, HttpServer, Stream, build_app, serve_http
from engine_service.common.openai_protocol import ModelCard
from engine_service.common.serving_flags import ServingOptions

if TYPE_CHECKING:  # the router loads it on first use
    from engine_service.common.tokenizer import Tokenizer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """grpc.health.v1 for the server ("") and each of its `services`, plus reflection; its
    state is also what HTTP /health answers."""

    def __init__(self, server: grpc.aio.Server, services: tuple[str, ...]) -> None:
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        reflection.enable_server_reflection(
            (*services, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self.services = ("", *services)
        self.serving = False

    async def set(self, serving: bool) -> None:
        self.serving = serving
        for name in self.services:
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)


async def start_openai(sock: socket.socket, options: ServingOptions, *, stream: Stream,
                       model: Callable[[], ModelCard | None], serving: Callable[[], bool],
                       tokenizer: Callable[[], Tokenizer | None],
                       registry: CollectorRegistry) -> HttpServer:
    """The OpenAI HTTP front on `sock` (http_server.bind_http), feeding `stream`, with the
    API key and TLS files of `options`."""
    backend = Backend(stream=stream, model=model, serving=serving, tokenizer=tokenizer,
                      registry=registry, api_key=options.api_key)
    return await serve_http(build_app(backend), sock, tls_cert=options.tls_cert,
                            tls_key=options.tls_key, tls_ca=options.tls_ca)
