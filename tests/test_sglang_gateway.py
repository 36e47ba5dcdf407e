"""benchmarks/sglang_gateway.py: SGLang's gateway is found, or refused with a reason naming
what is missing; and, when NANOSERVE_SGLANG_ROUTER names an installed gateway (`make test`
points it at the one `make venv` installs in .venv/sglang), it routes streamed completions
to real tiny engines (cache_aware keeps a repeated prompt on the engine that cached it)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from benchmarks import sglang_gateway
from benchmarks.procs import ServerProc
from benchmarks.sglang_gateway import ENV, GatewayUnavailable, start_gateway
from clients import Client
from tests.procs import start_engine

pytestmark = pytest.mark.timeout(240)

MODEL = "tiny-served"
ENGINE_ARGS = ("--http-port", "0", "--kv-block-size", "4", "--max-model-len", "512",
               "--served-model-name", MODEL)
PROMPT = "Hello there, tell me a story about routers and their caches"
MAX_TOKENS = 8


def test_gateway_installed_nowhere_is_unavailable_naming_the_package(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(sglang_gateway, "_installed_here", lambda: False)
    monkeypatch.setattr(sglang_gateway, "FALLBACK_PYTHON", tmp_path / "no-python")
    with contextlib.ExitStack() as stack, pytest.raises(GatewayUnavailable) as e:
        start_gateway(["127.0.0.1:1"], stack, start_timeout=5)
    assert "sglang-router" in str(e.value) and "pip install sglang-router" in str(e.value)


def test_env_var_naming_no_gateway_is_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path / "missing-python"))
    with contextlib.ExitStack() as stack, pytest.raises(GatewayUnavailable, match=ENV):
        start_gateway(["127.0.0.1:1"], stack, start_timeout=5)


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is not None,
                    reason="sglang-router is installed in the test interpreter")
def test_python_without_the_package_is_unavailable_naming_it(monkeypatch):
    monkeypatch.setenv(ENV, sys.executable)  # the project venv: kept free of sglang-router
    with contextlib.ExitStack() as stack, pytest.raises(GatewayUnavailable,
                                                        match="sglang-router"):
        start_gateway(["127.0.0.1:1"], stack, start_timeout=5)


# ---- a real gateway (NANOSERVE_SGLANG_ROUTER set: always under `make test`) -------------

@pytest.fixture(scope="module")
def engines(tiny_model_dir) -> Iterator[list[ServerProc]]:
    started: list[ServerProc] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(start_engine, tiny_model_dir, *ENGINE_ARGS) for _ in range(2)]
            started += [f.result() for f in futures if f.exception() is None]
            for f in futures:
                f.result()
        yield started
    finally:
        for proc in started:
            assert proc.stop() == 0, proc.output()[-3000:]


def stream_completion(address: str, prompt: str) -> tuple[str, dict]:
    """(text, usage) of one streamed greedy completion sent to `address` over HTTP."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text, usage = "", None
    with httpx.stream("POST", f"http://{address}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read().decode()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            text += "".join(c["text"] for c in chunk["choices"])
            usage = chunk.get("usage") or usage
    assert usage is not None, "the stream ended without usage"
    return text, usage


@pytest.mark.skipif(not os.environ.get(ENV), reason=f"{ENV} is not set (`make test` sets it to "
                    "the gateway `make venv` installs in .venv/sglang)")
def test_gateway_streams_completions_to_engines_and_keeps_a_prefix_on_one(engines):
    http = [f"127.0.0.1:{p.http_address()[1]}" for p in engines]
    with contextlib.ExitStack() as stack:
        address = start_gateway(http, stack, start_timeout=60)
        turns = [stream_completion(address, PROMPT) for _ in range(3)]
    # The reference comes after: sent first, it would warm one engine's cache.
    with Client(engines[0].target, timeout=60) as grpc_client:
        expected = grpc_client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                        ignore_eos=True)
    for text, usage in turns:
        assert text == expected.text
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            expected.usage.prompt_tokens, MAX_TOKENS)
    cached = [usage["prompt_tokens_details"]["cached_tokens"] for _, usage in turns]
    # The first turn finds a cold cache; cache_aware sends the repeats where it went, so
    # they hit (round robin over two engines would send the second one to a cold engine).
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    with pytest.raises(OSError):  # the stack stopped the gateway
        host, port = address.split(":")
        socket.create_connection((host, int(port)), timeout=2).close()
