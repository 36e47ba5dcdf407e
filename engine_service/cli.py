"""`nanoserve engine` flags. Torch-free at import: the console script builds parsers
without loading the engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from engine_service.common.tls import add_tls_arguments, check_tls_files, server_credentials
from engine_service.config import ATTENTION_BACKENDS, DEVICES, DTYPES, LOAD_FORMATS


def add_engine_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The EngineConfig flags (shared with `nanoserve bench`)."""
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--device", choices=DEVICES, default="auto")
    parser.add_argument("--dtype", choices=DTYPES, default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs for decode")
    parser.add_argument("--no-async-scheduling", dest="async_scheduling",
                        action="store_false",
                        help="wait for each step's tokens before scheduling the next (default: "
                        "the next step is launched while the device runs this one)")
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    parser.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                        help="dummy: random weights from config.json alone")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="requests queued beyond max-num-seqs before RESOURCE_EXHAUSTED")
    parser.add_argument("--core-watchdog-timeout", type=float, default=10.0,
                        help="seconds the engine core may make no progress while requests "
                        "are in flight before health turns NOT_SERVING and new requests get "
                        "UNAVAILABLE (it turns SERVING again once the core makes progress)")
    parser.add_argument("--seed", type=int, default=0)


def engine_config_from_args(args: argparse.Namespace):
    from engine_service.config import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype,
        tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_block_size=args.kv_block_size, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        attention_backend=args.attention_backend, load_format=args.load_format,
        max_waiting_requests=args.max_waiting_requests,
        core_watchdog_timeout=args.core_watchdog_timeout, seed=args.seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_config_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    parser.add_argument("--engine-id", default=None, help="id reported to clients "
                        "(default HOST:PORT)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="Prometheus /metrics port (default: off)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM")
    parser.add_argument("--log-level", default=os.environ.get("NANOSERVE_LOG_LEVEL", "INFO"))
    add_tls_arguments(parser, cert_help="serve TLS with this certificate chain",
                      ca_help="require client certificates signed by this CA (mTLS)")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    os.environ["NANOSERVE_LOG_LEVEL"] = args.log_level.upper()
    try:
        config = engine_config_from_args(args)
        check_tls_files(args.tls_cert, args.tls_key, args.tls_ca, ca_alone=False)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    from engine_service.server import serve

    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_ca)
    return asyncio.run(serve(config, host=args.host, port=args.port, engine_id=args.engine_id,
                             metrics_port=args.metrics_port, drain_timeout=args.drain_timeout,
                             credentials=credentials))
