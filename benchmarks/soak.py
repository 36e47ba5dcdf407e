"""`nanoserve bench soak --minutes M`: mixed load (greedy streams and unary calls checked
against a clean run, random cancels, short deadlines, bad requests) through a router to two
CPU engines, one SIGKILLed and restarted on its port every --restart-every minutes. Exit
status 1 on an unexplained outcome or a KV block held at idle. Torch-free."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import grpc
from tqdm.auto import tqdm

from benchmarks.procs import (
    ENGINE_READY,
    NANOSERVE,
    ROOT,
    ServerProc,
    core_pid,
    rss_bytes,
    start_engines,
    start_routers,
    threads_each,
)
from benchmarks.results import percentile, record
from nanoserve.v1 import nanoserve_pb2 as pb
from nanoserve.v1 import nanoserve_pb2_grpc as pb_grpc

OUTCOMES = ("ok", "cancelled", "deadline", "invalid", "unexplained")
KINDS, WEIGHTS = ("stream", "unary", "cancel", "deadline", "bad"), (35, 25, 15, 10, 15)
# Sent as they are (the Python client would refuse some itself); max_model_len is 512.
BAD = [pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(**kw))
       for ids, kw in (([1, 2, 10**6], {}), ([1] * 600, {}), ([1, 2], {"temperature": -1.0}),
                       ([1, 2], {"top_p": 1.5}), ([1, 2], {"stop": ["s" * 1000]}),
                       ([1, 2], {"max_tokens": 0}))]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the load runs")
    parser.add_argument("--restart-every", type=float, default=3.0, metavar="MINUTES",
                        help="SIGKILL an engine and start it on its port this often (0: never)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, metavar="DIR",
                        help="engines' model; None: `nanoserve tiny-model` in a temp dir")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="FLAG")
    parser.add_argument("--router-arg", action="append", default=[], metavar="FLAG")
    parser.add_argument("--start-timeout", type=float, default=180.0, metavar="S")
    parser.add_argument("--no-record", action="store_true", help="do not log the figures")


@dataclass
class SoakConfig:
    """The load's shape; the fields are the flags of the same names."""

    minutes: float
    restart_every: float  # minutes; 0: never
    concurrency: int
    seed: int

    def __post_init__(self) -> None:
        for name, ok, allowed in (("minutes", self.minutes > 0, "> 0"),
                                  ("restart_every", self.restart_every >= 0, ">= 0 (0: never)"),
                                  ("concurrency", self.concurrency >= 1, ">= 1")):
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {allowed}, "
                                 f"got {getattr(self, name)}")


@dataclass
class Soak:
    config: SoakConfig
    args: argparse.Namespace
    engines: list[ServerProc]
    router: ServerProc
    stack: contextlib.ExitStack
    requests: list[pb.GenerateRequest] = field(default_factory=list)  # greedy
    refs: list[list[int]] = field(default_factory=list)
    done: list[tuple[int, str, float]] = field(default_factory=list)  # (minute, outcome, s)
    unexplained: list[str] = field(default_factory=list)
    restarts: collections.Counter = field(default_factory=collections.Counter)
    router_rss: dict[int, int] = field(default_factory=dict)  # minute -> MiB at its end

    def processes(self) -> dict[str, int]:
        procs = {"router": self.router.proc.pid}
        for i, e in enumerate(self.engines):
            procs[f"engine {i}"] = e.proc.pid
            procs[f"engine {i} core"] = core_pid(e.proc.pid)
        return procs

    def restart(self, i: int) -> None:
        """SIGKILL engine i (its process group: frontend and core); start it on its port."""
        victim = self.engines[i]
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait(30)
        new = victim.restarted()
        self.stack.callback(new.stop)
        new.wait_for(ENGINE_READY, self.args.start_timeout)
        self.engines[i] = new
        self.restarts[f"engine {i}"] += 1
        tqdm.write(f"engine {i} ({victim.target}) killed (SIGKILL) and restarted")


async def _request(stub: pb_grpc.GenerationStub, s: Soak, rng: random.Random) -> str:
    """One random request; its outcome, and after "unexplained: " what happened."""
    kind = rng.choices(KINDS, WEIGHTS)[0]
    i = rng.randrange(len(s.requests))
    cancelled = False
    try:
        if kind in ("bad", "unary"):
            request = rng.choice(BAD) if kind == "bad" else s.requests[i]
            got = list((await stub.Generate(request, timeout=60)).token_ids)
        else:
            timeout = rng.uniform(0.01, 0.3) if kind == "deadline" else 60
            call = stub.Stream(s.requests[i], timeout=timeout)
            task = asyncio.ensure_future(_tokens(call))
            if kind == "cancel" and not (await asyncio.wait({task},
                                                            timeout=rng.uniform(0, 0.5)))[0]:
                cancelled = call.cancel()
            got = await task
    except asyncio.CancelledError:
        if not cancelled:
            raise
        return "cancelled"
    except grpc.aio.AioRpcError as e:
        expected = {"bad": (grpc.StatusCode.INVALID_ARGUMENT, "invalid"),
                    "deadline": (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline")}.get(kind)
        if expected and e.code() == expected[0]:
            return expected[1]
        if cancelled and e.code() == grpc.StatusCode.CANCELLED:  # ours, seen as a status
            return "cancelled"
        return f"unexplained: {kind} got {e.code().name}: {e.details()}"
    if kind == "bad":
        return f"unexplained: a bad request was served: {request.sampling}"
    return "ok" if got == s.refs[i] else f"unexplained: {kind} got other tokens than a clean run"


async def _tokens(call) -> list[int]:
    return [t async for chunk in call for t in chunk.token_ids]


async def _worker(stub: pb_grpc.GenerationStub, s: Soak, rng: random.Random, t0: float,
                  end: float) -> None:
    while (start := time.monotonic()) < end:
        outcome = await _request(stub, s, rng)
        now = time.monotonic()
        s.done.append((int((now - t0) // 60), outcome.split(":")[0], now - start))
        if outcome.startswith("unexplained"):
            s.unexplained.append(outcome)


async def _restarter(s: Soak, t0: float, end: float) -> None:
    every, k = s.config.restart_every * 60, 0
    while every and (due := t0 + (k + 1) * every) < end:
        await asyncio.sleep(due - time.monotonic())
        await asyncio.to_thread(s.restart, k % len(s.engines))
        k += 1


async def _ticker(s: Soak, t0: float, end: float) -> None:
    """The progress bar over the minutes, and each minute's row once it is over."""
    bar = tqdm(total=round(s.config.minutes, 2), unit="min", desc="soak", dynamic_ncols=True)
    shown = 0
    while (now := time.monotonic()) < end:
        await asyncio.sleep(min(1.0, end - now))
        bar.n = round((min(time.monotonic(), end) - t0) / 60, 2)
        bar.refresh()
        while shown < int((time.monotonic() - t0) // 60):
            s.router_rss[shown] = rss_bytes(s.router.proc.pid) >> 20
            bar.write(_row(str(shown), [d for d in s.done if d[0] == shown],
                           s.router_rss[shown]))
            shown += 1
    bar.close()


def _row(label: str, done: list[tuple[int, str, float]], rss: int | None = None) -> str:
    counts = collections.Counter(outcome for _, outcome, _ in done)
    ok = [seconds * 1e3 for _, outcome, seconds in done if outcome == "ok"]
    p50 = f"{statistics.median(ok):.0f}" if ok else "-"
    return (f"| {label} | " + " | ".join(str(counts[o]) for o in OUTCOMES)
            + f" | {p50} | {percentile(ok, 99):.0f} | {'-' if rss is None else rss} |")


async def _load(s: Soak) -> None:
    from clients import AsyncClient

    async with AsyncClient(s.engines[0].target) as engine:
        info = await engine.model_info()
    rng = random.Random(s.config.seed)
    vocab = min(info.vocab_size, 10000)
    shared = [rng.randrange(vocab) for _ in range(32)]  # a prefix the cache can share
    s.requests = [pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=(shared if i % 2 else [])
                              + [rng.randrange(vocab) for _ in range(rng.randint(4, 48))]),
        sampling=pb.SamplingParams(max_tokens=rng.randint(4, 48), temperature=0.0,
                                   ignore_eos=True)) for i in range(16)]
    async with grpc.aio.insecure_channel(s.router.target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        outs = await asyncio.gather(*(stub.Generate(r, timeout=120) for r in s.requests))
        s.refs = [list(o.token_ids) for o in outs]
        t0 = time.monotonic()
        end = t0 + s.config.minutes * 60
        await asyncio.gather(_ticker(s, t0, end), _restarter(s, t0, end),
                             *(_worker(stub, s, random.Random(s.config.seed * 1000 + w), t0,
                                       end) for w in range(s.config.concurrency)))


def _blocks_at_idle(s: Soak, timeout: float = 30.0) -> dict[str, int]:
    """Each engine's KV blocks used once no request runs (aborts reach the core late)."""
    from clients import Client

    used = {}
    for i, e in enumerate(s.engines):
        with Client(e.target, timeout=5) as c:
            deadline = time.monotonic() + timeout
            while (load := c.load()).kv_blocks_used and time.monotonic() < deadline:
                time.sleep(0.1)
        used[f"engine {i}"] = load.kv_blocks_used
    return used


def _report(s: Soak, rss: list[dict[str, int]], blocks: dict[str, int]) -> str:
    minutes = max((m for m, _, _ in s.done), default=-1) + 1
    rows = ["| minute | " + " | ".join(OUTCOMES) + " | p50 ms | p99 ms | router RSS MiB |",
            "|---" * (len(OUTCOMES) + 4) + "|"]
    rows += [_row(str(m), [d for d in s.done if d[0] == m], s.router_rss.get(m))
             for m in range(minutes)]
    rows += [_row("total", s.done), "", "| process | RSS start MiB | RSS end MiB | restarts |",
             "|---|---|---|---|"]
    rows += [f"| {name} | {rss[0][name] / 2**20:.0f} | {rss[1][name] / 2**20:.0f} | "
             f"{s.restarts[name.removesuffix(' core')]} |" for name in rss[0]]
    return "\n".join(rows) + "\n\nKV blocks used at idle: " + ", ".join(
        f"{name} {n}" for name, n in blocks.items())


def main(args: argparse.Namespace) -> int:
    try:
        config = SoakConfig(args.minutes, args.restart_every, args.concurrency, args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the engines and the router this run started are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with contextlib.ExitStack() as stack:
        if args.model is None:
            args.model = stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-"))
            subprocess.run([*NANOSERVE, "tiny-model", args.model], cwd=ROOT, check=True,
                           capture_output=True)
        engines = start_engines(
            args.model, "--http-port", "0", "--device", "cpu", "--dtype", "float32",
            "--num-kv-blocks", "2048", "--max-model-len", "512", *args.engine_arg, n=2,
            timeout=args.start_timeout, env=threads_each(2), max_lines=400, stack=stack)
        router, = start_routers([e.target for e in engines], "--policy", "prefix",
                                *args.router_arg, timeout=args.start_timeout, serving=True,
                                max_lines=400, stack=stack)
        s = Soak(config, args, engines, router, stack)
        rss = [{name: rss_bytes(pid) for name, pid in s.processes().items()}]
        asyncio.run(_load(s))
        blocks = _blocks_at_idle(s)
        rss.append({name: rss_bytes(pid) for name, pid in s.processes().items()})
    text = _report(s, rss, blocks)
    print(f"\n{text}")
    for line in s.unexplained[:10]:
        print(line, file=sys.stderr)
    if not args.no_record:
        record("soak: mixed load, cancels, deadlines, bad requests, engine restarts",
               {"run": f"{args.minutes} min, concurrency {args.concurrency}, an engine "
                       f"restarted every {args.restart_every} min", "table": "\n\n" + text})
    return 1 if s.unexplained or any(blocks.values()) else 0
