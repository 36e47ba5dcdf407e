"""`nanoserve engine` flags. Torch-free at import: the console script builds parsers
without loading the engine."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from engine_service.common.serving_flags import (
    ServingOptions,
    add_serving_arguments,
    dataclass_from_args,
)
from engine_service.common.tls import add_tls_arguments, check_tls_files, server_credentials
from engine_service.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    LOAD_FORMATS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    EngineConfig,
)


def add_engine_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The EngineConfig flags (shared with `nanoserve bench`), defaults from EngineConfig
    so help and config cannot disagree."""
    d = EngineConfig
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    add = parser.add_argument
    add("--model", required=True, metavar="DIR",
        help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    add("--device", choices=DEVICES, default=d.device, help="auto: cuda when available")
    add("--dtype", choices=DTYPES, default=d.dtype,
        help="weights and KV cache; auto: the checkpoint's torch_dtype (float32 on CPU)")
    add("--tensor-parallel-size", type=int, default=d.tensor_parallel_size, metavar="N",
        help="shard the model over N GPUs (N processes; gloo on CPU)")
    add("--max-model-len", type=int, default=d.max_model_len, metavar="TOKENS",
        help="longest prompt + output; None: the model's max_position_embeddings")
    add("--max-num-seqs", type=int, default=d.max_num_seqs, metavar="N",
        help="requests in one batch at most")
    add("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
        metavar="TOKENS", help="tokens in one step at most (longer prefills are chunked)")
    add("--kv-block-size", type=int, default=d.kv_block_size, metavar="TOKENS",
        help="tokens per KV-cache block (flash-attn: a multiple of 256)")
    add("--num-kv-blocks", type=int, default=d.num_kv_blocks, metavar="N",
        help="KV-cache blocks; None: sized from --gpu-memory-utilization (on CPU, from a "
             "fixed memory budget)")
    add("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
        metavar="FRACTION", help="share of GPU memory for weights, activations and KV cache")
    add("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    add("--no-async-scheduling", dest="async_scheduling", action="store_false",
        help="wait for each step's tokens before scheduling the next (otherwise the next "
             "step is launched while the device runs this one)")
    add("--attention-backend", choices=ATTENTION_BACKENDS, default=d.attention_backend,
        help="auto: triton on GPU, torch on CPU")
    add("--load-format", choices=LOAD_FORMATS, default=d.load_format,
        help="dummy: random weights from config.json alone")
    add("--scheduling-policy", choices=SCHEDULING_POLICIES, default=d.scheduling_policy,
        help="fcfs: arrival order; priority: lower request priority first, then arrival "
             "(a more urgent request may preempt less urgent running ones)")
    add("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
        help="speculative decoding: ngram (prompt lookup) or draft (a smaller model's "
             "proposals); verified by the model, so outputs do not change")
    add("--num-speculative-tokens", type=int, default=None, metavar="K",
        help="tokens proposed per step (with --speculative-method)")
    add("--prompt-lookup-min", type=int, default=None, metavar="N",
        help="ngram: shortest suffix looked up in the prompt and output (default: "
             "--prompt-lookup-max, else 5)")
    add("--prompt-lookup-max", type=int, default=None, metavar="N",
        help="ngram: longest suffix looked up (default: max(--prompt-lookup-min, 5))")
    add("--speculative-model", default=None, metavar="DIR",
        help="draft: model directory with the same vocabulary; its KV cache shares the "
             "target's blocks")
    add("--speculative-disable-by-batch-size", type=int,
        default=d.speculative_disable_by_batch_size, metavar="N",
        help="speculate only while at most N requests run")
    add("--max-waiting-requests", type=int, default=d.max_waiting_requests, metavar="N",
        help="requests queued beyond --max-num-seqs before RESOURCE_EXHAUSTED")
    add("--core-watchdog-timeout", type=float, default=d.core_watchdog_timeout, metavar="S",
        help="seconds the engine core may make no progress while requests are in flight "
             "before health turns NOT_SERVING and new requests get UNAVAILABLE (it turns "
             "SERVING again once the core makes progress)")
    add("--seed", type=int, default=d.seed,
        help="torch's seed, and that of --load-format dummy's random weights")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return dataclass_from_args(EngineConfig, args)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_config_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (also metrics)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: pick a free one)")
    parser.add_argument("--engine-id", default=None, help="id reported to clients; None: "
                        "HOST:PORT")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="Prometheus /metrics port; None: off")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                        help="seconds in-flight requests get to finish after SIGTERM")
    parser.add_argument("--log-level", default=os.environ.get("NANOSERVE_LOG_LEVEL", "INFO"),
                        help="logging level (env NANOSERVE_LOG_LEVEL sets the default)")
    add_serving_arguments(parser, http_port=None,
                          model_name_help="None: the model directory's name")
    add_tls_arguments(parser, cert_help="serve TLS (gRPC and HTTP) with this certificate chain; "
                      "the files are reread when they change (rotation needs no restart)",
                      ca_help="require client certificates signed by this CA (mTLS)")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s engine %(levelname)s %(name)s: %(message)s")
    os.environ["NANOSERVE_LOG_LEVEL"] = args.log_level.upper()
    try:
        config = engine_config_from_args(args)
        check_tls_files(args.tls_cert, args.tls_key, args.tls_ca, ca_alone=False)
        serving = dataclass_from_args(ServingOptions, args)
    except ValueError as e:
        print(f"error: {e}")
        return 2
    from engine_service.server import serve

    try:
        credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_ca)
        return asyncio.run(serve(config, host=args.host, port=args.port,
                                 engine_id=args.engine_id, metrics_port=args.metrics_port,
                                 drain_timeout=args.drain_timeout, credentials=credentials,
                                 serving=serving))
    except OSError as e:  # a port that is taken, TLS files that do not load: it names them
        print(f"nanoserve engine: error: {e}", file=sys.stderr)
        return 1
