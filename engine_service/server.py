"""`nanoserve engine`: the gRPC frontend process, which starts the engine core process,
serves Generation + Engine + health + reflection, and drains on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import signal
from pathlib import Path

import grpc

from engine_service import core_process as core
from engine_service.common.api_key import api_key_interceptors
from engine_service.common.http_server import bind_http
from engine_service.common.proto_convert import (
    MAX_PROMPT_BYTES_PER_TOKEN,
    MAX_REQUEST_BYTES,
    StatusInterceptor,
)
from engine_service.common.serving import Health, start_openai
from engine_service.common.serving_flags import ServingOptions
from engine_service.common.tls import add_port
from engine_service.config import EngineConfig
from engine_service.frontend import Frontend
from engine_service.metrics import EngineMetrics
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)
SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["Generation"].full_name,
    pb.DESCRIPTOR.services_by_name["Engine"].full_name,
)
REQUEST_FIELDS_ROOM = 1 << 20  # sampling parameters, chat roles, framing


def start_core_process(config: EngineConfig):
    """Spawn the core; return (process, requests sender, outputs receiver)."""
    ctx = mp.get_context("spawn")
    req_recv, req_send = ctx.Pipe(duplex=False)
    out_recv, out_send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=core.run_core, args=(config, req_recv, out_send),
                       name="nanoserve-core", daemon=True)
    proc.start()
    # Close our copies of the child's ends so either side sees EOF when the other dies.
    req_recv.close()
    out_send.close()
    return proc, req_send, out_recv


async def serve(config: EngineConfig, *, host: str, port: int, engine_id: str | None,
                metrics_port: int | None, drain_timeout: float,
                credentials: grpc.ServerCredentials | None = None,
                serving: ServingOptions | None = None) -> int:
    serving = serving or ServingOptions()
    # The router's limit at least, so a prompt too large for this model is refused here with
    # INVALID_ARGUMENT naming its limit; grpc refuses anything larger before it is parsed.
    max_message = max(MAX_REQUEST_BYTES,
                      config.max_model_len * MAX_PROMPT_BYTES_PER_TOKEN + REQUEST_FIELDS_ROOM)
    server = grpc.aio.server(interceptors=[*api_key_interceptors(serving.api_key),
                                           StatusInterceptor()],
                             options=[("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", max_message)])
    # Both ports first: a taken one fails at once (OSError naming it), before the model loads.
    bound = add_port(server, f"{host}:{port}", credentials)
    model_name = serving.served_model_name or Path(config.model).name
    metrics = EngineMetrics(model_name=model_name)
    if metrics_port:
        metrics.serve(metrics_port, host)
    http_socket = None if serving.http_port is None else bind_http(host, serving.http_port)
    proc, req_send, out_recv = start_core_process(config)
    frontend = Frontend(model_dir=config.model, engine_id=engine_id or f"{host}:{bound}",
                        requests=req_send, outputs=out_recv,
                        max_in_flight=config.max_num_seqs + config.max_waiting_requests,
                        metrics=metrics, model_name=model_name)
    metrics.core_stalled.set_function(lambda: float(frontend.core_stalled))
    pb_grpc.add_GenerationServicer_to_server(frontend, server)
    pb_grpc.add_EngineServicer_to_server(frontend, server)
    health = Health(server, SERVICE_NAMES)
    await health.set(False)
    await server.start()
    frontend.start()
    print(f"nanoserve engine listening on {host}:{bound}", flush=True)
    http = None
    if http_socket is not None:
        http = await start_openai(
            http_socket, serving, stream=frontend.Stream, model=frontend.model_card,
            serving=lambda: health.serving, tokenizer=lambda: frontend.tokenizer,
            registry=metrics.registry)
        print(f"nanoserve engine OpenAI API on {http.scheme}://{host}:{http.port}", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def watch_core() -> None:
        """NOT_SERVING while the core owes output but sends nothing (hung or stopped),
        SERVING again once it does; a cheap poll, so the loop stays free."""
        stalled = False
        tick = min(1.0, config.core_watchdog_timeout / 4)
        while True:
            await asyncio.sleep(tick)
            now_stalled = frontend.check_core_progress(config.core_watchdog_timeout)
            if now_stalled != stalled:
                stalled = now_stalled
                await health.set(not stalled)

    ready = asyncio.create_task(frontend.ready.wait())
    gone = asyncio.create_task(frontend.core_gone.wait())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({ready, gone, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if frontend.ready.is_set() and not frontend.core_gone.is_set():
        await health.set(True)
        print("nanoserve engine ready", flush=True)
        watchdog = asyncio.create_task(watch_core())
        await asyncio.wait({gone, stopping}, return_when=asyncio.FIRST_COMPLETED)
        watchdog.cancel()  # draining or the core died: health stays NOT_SERVING from here
        with contextlib.suppress(asyncio.CancelledError):
            await watchdog

    exit_code = 0
    if frontend.core_gone.is_set():
        logger.error("engine core is gone; serving stops: %s", frontend.core_error)
        exit_code = 1
    await health.set(False)
    frontend.accepting = False
    if exit_code == 0:
        try:  # drain: in-flight requests finish, new ones get UNAVAILABLE
            await asyncio.wait_for(frontend.idle.wait(), timeout=drain_timeout)
        except asyncio.TimeoutError:
            logger.warning("drain timeout (%.0fs) with %d requests in flight", drain_timeout,
                           len(frontend.registry))
    await server.stop(grace=1.0)
    if http is not None:
        await http.stop(grace=1.0)
    frontend.stopping = True
    with contextlib.suppress(OSError):
        req_send.send(core.Shutdown())
    await loop.run_in_executor(None, proc.join, 30)
    if proc.is_alive():
        proc.kill()
    for t in (ready, gone, stopping):
        t.cancel()
    return exit_code

