"""`nanoserve bench serve --target HOST:PORT`: the nano-vllm bench workload as concurrent
gRPC streams; output tok/s, TTFT and inter-token latency percentiles."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from tqdm.auto import tqdm

from benchmarks.results import percentile, record
from benchmarks.workload import BenchRequest, add_workload_arguments, workload_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="engine or router HOST:PORT")
    parser.add_argument("--concurrency", type=int, default=0,
                        help="streams open at once (0: every request at once)")
    add_workload_arguments(parser)
    parser.add_argument("--no-record", action="store_true", help="do not log the figures")


async def _one(client, req: BenchRequest, seed: int, temperature: float, sem, bar,
               ttfts: list[float], itls: list[float]) -> int:
    async with sem:
        t0 = time.perf_counter()
        last = None
        n = 0
        async for chunk in client.stream(req.prompt_token_ids, max_tokens=req.max_tokens,
                                         temperature=temperature, ignore_eos=True, seed=seed):
            now = time.perf_counter()
            k = len(chunk.token_ids)
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
    from clients import AsyncClient

    async with AsyncClient(args.target) as client:
        info = await client.model_info()
        reqs = workload_from_args(args, info.vocab_size)
        sem = asyncio.Semaphore(args.concurrency or len(reqs))
        ttfts: list[float] = []
        itls: list[float] = []
        bar = tqdm(total=len(reqs), desc="Streams", dynamic_ncols=True)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(
            _one(client, r, i, args.temperature, sem, bar, ttfts, itls)
            for i, r in enumerate(reqs)))
        elapsed = time.perf_counter() - t0
        bar.close()
    total = sum(counts)
    expected = sum(r.max_tokens for r in reqs)
    if total != expected:
        raise SystemExit(f"error: expected {expected} tokens (ignore_eos), got {total}")
    return {"requests": len(reqs), "tokens": total, "seconds": elapsed,
            "throughput": total / elapsed,
            "ttft_p50": statistics.median(ttfts), "ttft_p99": percentile(ttfts, 99),
            "itl_p50": statistics.median(itls) if itls else float("nan"),
            "itl_p99": percentile(itls, 99)}


def main(args: argparse.Namespace) -> int:
    r = asyncio.run(run(args))
    print(f"Requests: {r['requests']}  Output tokens: {r['tokens']}  Time: {r['seconds']:.2f}s")
    print(f"Throughput: {r['throughput']:.2f} tok/s  TTFT p50/p99: {r['ttft_p50']*1e3:.1f}/"
          f"{r['ttft_p99']*1e3:.1f} ms  ITL p50/p99: {r['itl_p50']*1e3:.2f}/"
          f"{r['itl_p99']*1e3:.2f} ms")
    if not args.no_record:
        record(f"serving throughput against {args.target}", {
            "requests": str(r["requests"]), "output tokens": str(r["tokens"]),
            "throughput": f"{r['throughput']:.1f} output tok/s",
            "TTFT p50 / p99": f"{r['ttft_p50']*1e3:.1f} / {r['ttft_p99']*1e3:.1f} ms",
            "inter-token latency p50 / p99":
                f"{r['itl_p50']*1e3:.2f} / {r['itl_p99']*1e3:.2f} ms"})
    return 0
