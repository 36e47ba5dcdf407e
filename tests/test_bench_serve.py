"""`nanoserve bench serve`: a small workload against one real engine, over gRPC and over its
OpenAI HTTP front (--http); both must deliver every token the workload asks for."""

from __future__ import annotations

import argparse
import asyncio
import signal

from benchmarks import serve
from tests.procs import start_engine
from tests.test_openai_api import with_http


def test_bench_serve_grpc_and_http(tiny_model_dir):
    engine = start_engine(tiny_model_dir, "--max-model-len", "512", "--http-port", "0")
    try:
        http = with_http(engine)
        parser = argparse.ArgumentParser()
        serve.add_arguments(parser)
        small = ["--num-seqs", "6", "--max-input-len", "64", "--max-output-len", "24",
                 "--min-output-len", "8", "--no-record"]
        results = {}
        for name, target in (("grpc", [engine.target]),
                             ("http", [http.url.removeprefix("http://"), "--http"])):
            args = parser.parse_args(["--target", *target, *small])
            results[name] = asyncio.run(serve.run(args))  # exits if a token is missing
        assert results["grpc"]["tokens"] == results["http"]["tokens"] > 0
        assert results["http"]["ttft_p50"] > 0 and results["http"]["itl_p50"] > 0
    finally:
        engine.stop(signal.SIGTERM)
