"""`nanoserve bench serve --target HOST:PORT [--http]`: the nano-vllm bench workload as
concurrent streams, gRPC or (--http: the target is an HTTP port) OpenAI /v1/completions
with server-sent events; output tok/s, TTFT and inter-token latency percentiles."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import AsyncIterator

from tqdm.auto import tqdm

from benchmarks.results import percentile, record
from benchmarks.routing_senders import sse_events
from benchmarks.workload import BenchRequest, add_workload_arguments, workload_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="engine or router HOST:PORT")
    parser.add_argument("--http", action="store_true",
                        help="--target is an OpenAI HTTP port: stream /v1/completions")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="the model's (default: ask the target; a router's gRPC port, "
                             "which serves no Engine service, needs it given)")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="streams open at once (0: every request at once)")
    add_workload_arguments(parser)
    parser.add_argument("--no-record", action="store_true", help="do not log the figures")


async def _grpc_stream(client, req: BenchRequest, seed: int, temperature: float
                       ) -> AsyncIterator[int]:
    """Tokens per chunk."""
    async for chunk in client.stream(req.prompt_token_ids, max_tokens=req.max_tokens,
                                     temperature=temperature, ignore_eos=True, seed=seed):
        yield len(chunk.token_ids)


async def _http_stream(session, req: BenchRequest, seed: int, temperature: float
                       ) -> AsyncIterator[int]:
    """Tokens per read: each choice event counts one token (text may be empty: ids the
    tokenizer cannot show), the usage event the rest."""
    body = {"model": None, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
            "temperature": temperature, "ignore_eos": True, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}
    async with session.post("/v1/completions", json=body) as response:
        response.raise_for_status()
        counted = 0
        async for events in sse_events(response):
            tokens = 0
            for payload in events:
                if payload.get("usage"):
                    tokens += payload["usage"]["completion_tokens"] - counted
                elif payload["choices"]:
                    counted += 1
                    tokens += 1
            if tokens:
                yield tokens


async def _server_info(session) -> dict:
    async with session.get("/get_server_info") as response:
        response.raise_for_status()
        return await response.json()


async def _one(stream, req: BenchRequest, seed: int, temperature: float, sem, bar,
               ttfts: list[float], itls: list[float]) -> int:
    async with sem:
        t0 = time.perf_counter()
        last = None
        n = 0
        async for k in stream(req, seed, temperature):
            now = time.perf_counter()
            if k:
                if last is None:
                    ttfts.append(now - t0)
                else:
                    itls.extend([(now - last) / k] * k)
                last = now
                n += k
        bar.update(1)
        return n


async def run(args: argparse.Namespace) -> dict[str, float]:
    if args.http:
        # aiohttp, as vLLM's serving benchmark: httpx's pure-Python HTTP/1.1 costs the client
        # about twice what the server spends on an event
        import aiohttp

        client = aiohttp.ClientSession(f"http://{args.target}",
                                       connector=aiohttp.TCPConnector(limit=0),
                                       timeout=aiohttp.ClientTimeout(total=None))
        vocab = lambda: _server_info(client)
        stream = lambda req, seed, t: _http_stream(client, req, seed, t)
    else:
        from clients import AsyncClient

        client = AsyncClient(args.target)
        vocab = client.model_info
        stream = lambda req, seed, t: _grpc_stream(client, req, seed, t)
    async with client:
        vocab_size = args.vocab_size
        if vocab_size is None:
            info = await vocab()
            vocab_size = info["vocab_size"] if args.http else info.vocab_size
        reqs = workload_from_args(args, vocab_size)
        sem = asyncio.Semaphore(args.concurrency or len(reqs))
        ttfts: list[float] = []
        itls: list[float] = []
        bar = tqdm(total=len(reqs), desc="Streams", dynamic_ncols=True)
        t0, cpu0 = time.perf_counter(), time.process_time()
        counts = await asyncio.gather(*(
            _one(stream, r, i, args.temperature, sem, bar, ttfts, itls)
            for i, r in enumerate(reqs)))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        bar.close()
    total = sum(counts)
    expected = sum(r.max_tokens for r in reqs)
    if total != expected:
        raise SystemExit(f"error: expected {expected} tokens (ignore_eos), got {total}")
    return {"requests": len(reqs), "tokens": total, "seconds": elapsed, "client_cpu": cpu,
            "throughput": total / elapsed,
            "ttft_p50": statistics.median(ttfts), "ttft_p99": percentile(ttfts, 99),
            "itl_p50": statistics.median(itls) if itls else float("nan"),
            "itl_p99": percentile(itls, 99)}


def main(args: argparse.Namespace) -> int:
    r = asyncio.run(run(args))
    print(f"Requests: {r['requests']}  Output tokens: {r['tokens']}  Time: {r['seconds']:.2f}s"
          f"  client CPU {r['client_cpu']:.2f} s")
    print(f"Throughput: {r['throughput']:.2f} tok/s  TTFT p50/p99: {r['ttft_p50']*1e3:.1f}/"
          f"{r['ttft_p99']*1e3:.1f} ms  ITL p50/p99: {r['itl_p50']*1e3:.2f}/"
          f"{r['itl_p99']*1e3:.2f} ms")
    if not args.no_record:
        record(f"serving throughput against {args.target}{' (HTTP)' * args.http}", {
            "requests": str(r["requests"]), "output tokens": str(r["tokens"]),
            "throughput": f"{r['throughput']:.1f} output tok/s",
            "TTFT p50 / p99": f"{r['ttft_p50']*1e3:.1f} / {r['ttft_p99']*1e3:.1f} ms",
            "inter-token latency p50 / p99":
                f"{r['itl_p50']*1e3:.2f} / {r['itl_p99']*1e3:.2f} ms"})
    return 0
