"""`nanoserve bench routing`: one multi-tenant chat workload replayed under each routing
policy; prefix-cache hit rate, TTFT p50/p99, output tok/s and requests per engine.

Workload: `--tenants` tenants, each with its own system prompt of `--system-prompt-len`
token ids, and `--conversations-per-tenant` conversations of `--turns` turns. A turn's
prompt is the system prompt, every earlier user message and reply, and a new user message,
all token ids (no tokenizer needed); greedy, `ignore_eos`, `--max-tokens` new tokens.
Conversations start as a Poisson process (`--rate` per second, seeded) in a shuffled tenant
order; a conversation's next turn is sent when its previous turn has finished and its user
has thought for a while (exponential, mean `--think-time`, drawn with the workload). Think
time is what keeps many conversations of many tenants open at once, as in a real chat
service; without it only one or two conversations are ever active, every engine's LRU holds
them, and no routing policy can do much better than another.

Fairness: every policy gets the same schedule and the same prompts against cold engines.
With `--model` the benchmark starts `--num-engines` engine processes and one router per
policy, and restarts the engines between policies (simplest way to empty their prefix
caches: no RPC flushes a cache). With `--engine` (engines already running) caches cannot be
emptied, so each policy's token ids are shifted by the policy's index modulo the vocabulary:
the same shape of workload, prompts no earlier policy has sent. The router is always the
benchmark's own, one per policy.

Torch-free: it only starts processes and talks gRPC.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import random
import re
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from benchmarks.procs import ServerProc
from benchmarks.results import percentile, record
from router.policy import POLICIES

_ENGINE_SERVING = re.compile(r"engine (\S+) \(.*\) is serving")


# ---- workload ---------------------------------------------------------------------------

@dataclass
class Conversation:
    tenant: int
    start: float                    # seconds after the run starts
    user_messages: list[list[int]]  # one per turn
    think_times: list[float]        # pause before turn i + 1, after turn i has finished

    def __post_init__(self) -> None:
        if len(self.think_times) != len(self.user_messages) - 1:
            raise ValueError(f"{len(self.user_messages)} turns need "
                             f"{len(self.user_messages) - 1} think times, "
                             f"got {len(self.think_times)}")


@dataclass
class Workload:
    system_prompts: list[list[int]]  # one per tenant
    conversations: list[Conversation]
    max_tokens: int

    def __post_init__(self) -> None:
        if not self.system_prompts or not self.conversations:
            raise ValueError("a workload needs at least one tenant and one conversation")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def num_requests(self) -> int:
        return sum(len(c.user_messages) for c in self.conversations)

    def longest_sequence(self) -> int:
        """Tokens of the longest turn's prompt plus its reply."""
        return max(len(self.system_prompts[c.tenant])
                   + sum(len(m) + self.max_tokens for m in c.user_messages)
                   for c in self.conversations)

    def shifted(self, shift: int, vocab: int) -> Workload:
        """The same workload with every token id moved by `shift` modulo `vocab`."""
        move = lambda ids: [(t + shift) % vocab for t in ids]
        return Workload([move(p) for p in self.system_prompts],
                        [Conversation(c.tenant, c.start, [move(m) for m in c.user_messages],
                                      c.think_times) for c in self.conversations],
                        self.max_tokens)


def make_workload(tenants: int, conversations_per_tenant: int, turns: int,
                  system_prompt_len: int, user_message_len: int, max_tokens: int,
                  rate: float, seed: int, vocab: int, think_time: float = 0.0) -> Workload:
    """Random token ids in [0, vocab); conversation starts at Poisson times (rate <= 0: all
    at t=0) in a shuffled order of tenants; think times exponential with mean `think_time`
    (0: none), drawn here so every policy waits the same."""
    for name, value in (("tenants", tenants), ("conversations_per_tenant",
                        conversations_per_tenant), ("turns", turns),
                        ("system_prompt_len", system_prompt_len),
                        ("user_message_len", user_message_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(vocab) for _ in range(n)]
    system_prompts = [ids(system_prompt_len) for _ in range(tenants)]
    order = [t for t in range(tenants) for _ in range(conversations_per_tenant)]
    rng.shuffle(order)
    conversations, now = [], 0.0
    for tenant in order:
        think = [rng.expovariate(1 / think_time) if think_time > 0 else 0.0
                 for _ in range(turns - 1)]
        conversations.append(Conversation(tenant, now,
                                          [ids(user_message_len) for _ in range(turns)], think))
        if rate > 0:
            now += rng.expovariate(rate)
    return Workload(system_prompts, conversations, max_tokens)


# ---- one policy's run -------------------------------------------------------------------

@dataclass
class TurnResult:
    ttft: float
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    engine_id: str


@dataclass
class PolicyResult:
    policy: str
    turns: list[TurnResult]
    errors: list[str]
    seconds: float
    engine_order: list[str] = field(default_factory=list)  # engine ids in launch order

    @property
    def hit_rate(self) -> float:
        prompt = sum(t.prompt_tokens for t in self.turns)
        return sum(t.cached_prompt_tokens for t in self.turns) / prompt if prompt else 0.0

    @property
    def ttft_p50(self) -> float:
        return statistics.median(t.ttft for t in self.turns) if self.turns else float("nan")

    @property
    def ttft_p99(self) -> float:
        return percentile([t.ttft for t in self.turns], 99)

    @property
    def throughput(self) -> float:
        return sum(t.completion_tokens for t in self.turns) / self.seconds

    def per_engine(self) -> list[int]:
        """Requests each engine served: launch order first, then any other id seen."""
        counts = collections.Counter(t.engine_id for t in self.turns)
        keys = list(self.engine_order) + sorted(set(counts) - set(self.engine_order))
        return [counts.get(k, 0) for k in keys]


async def _conversation(client, workload: Workload, conv: Conversation, t0: float,
                        timeout: float, bar, out: list[TurnResult], errors: list[str]) -> None:
    await asyncio.sleep(max(0.0, t0 + conv.start - time.perf_counter()))
    history = list(workload.system_prompts[conv.tenant])
    for i, user in enumerate(conv.user_messages):
        if i:
            await asyncio.sleep(conv.think_times[i - 1])
        prompt = history + user
        start, ttft, reply, usage, engine_id = time.perf_counter(), None, [], None, ""
        try:
            async for chunk in client.stream(prompt, max_tokens=workload.max_tokens,
                                             temperature=0.0, ignore_eos=True,
                                             timeout=timeout):
                if chunk.token_ids and ttft is None:
                    ttft = time.perf_counter() - start
                reply += chunk.token_ids
                usage = chunk.usage or usage
                engine_id = chunk.engine_id or engine_id
        except Exception as e:  # a failed turn ends its conversation: no reply to build on
            errors.append(f"{type(e).__name__}: {e}")
            bar.update(len(conv.user_messages) - i)
            return
        if ttft is None or usage is None:
            errors.append(f"a stream ended without {'tokens' if ttft is None else 'usage'}")
            bar.update(len(conv.user_messages) - i)
            return
        out.append(TurnResult(ttft, usage.prompt_tokens, usage.cached_prompt_tokens,
                              usage.completion_tokens, engine_id))
        history = prompt + reply
        bar.update(1)


async def run_policy(target: str, policy: str, workload: Workload,
                     timeout: float) -> PolicyResult:
    """Replay `workload` against the router at `target`."""
    from clients import AsyncClient

    turns: list[TurnResult] = []
    errors: list[str] = []
    bar = tqdm(total=workload.num_requests, desc=f"{policy:>11}", dynamic_ncols=True)
    async with AsyncClient(target) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_conversation(client, workload, c, t0, timeout, bar, turns,
                                             errors) for c in workload.conversations))
        seconds = time.perf_counter() - t0
    bar.close()
    return PolicyResult(policy, turns, errors, seconds)


# ---- processes --------------------------------------------------------------------------

def engine_args(args: argparse.Namespace) -> list[str]:
    out = ["engine", "--model", args.model, "--host", "127.0.0.1", "--port", "0",
           "--device", args.device]
    for flag in ("dtype", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs",
                 "kv_block_size", "max_model_len"):
        value = getattr(args, flag)
        if value is not None:
            out += ["--" + flag.replace("_", "-"), str(value)]
    return out + list(args.engine_arg)


def start_engines(args: argparse.Namespace, stack: contextlib.ExitStack) -> list[ServerProc]:
    """`--num-engines` engines, started together, each waited for."""
    # Engines share the host's cores; one torch thread pool each keeps them from fighting.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1)
                                                           // args.num_engines))
    procs = []
    for i in range(args.num_engines):
        env = {"OMP_NUM_THREADS": threads}
        if args.engine_devices:
            devices = args.engine_devices.split(",")
            env["CUDA_VISIBLE_DEVICES"] = devices[i % len(devices)]
        p = ServerProc(f"engine {i}", engine_args(args), env, max_lines=400)
        stack.callback(p.stop)
        procs.append(p)
    for p in procs:
        p.wait_until(lambda lines: any("nanoserve engine ready" in x for x in lines),
                     "ready", args.start_timeout)
    return procs


def start_router(args: argparse.Namespace, engines: list[str], policy: str,
                 stack: contextlib.ExitStack) -> ServerProc:
    """A router for `policy`, returned once every engine is serving in its pool."""
    cmd = ["router", "--host", "127.0.0.1", "--port", "0", "--http-port", "0", "--policy", policy]
    for e in engines:
        cmd += ["--engine", e]
    for flag in ("cache_weight", "load_guard_ratio", "load_guard_min"):
        value = getattr(args, flag)
        if value is not None:
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    p = ServerProc(f"router ({policy})", cmd + list(args.router_arg), max_lines=400)
    stack.callback(p.stop)
    p.wait_until(lambda lines: any("router listening on" in x for x in lines)
                 and len({m.group(1) for x in lines if (m := _ENGINE_SERVING.search(x))})
                 >= len(engines), f"all {len(engines)} engines serving", args.start_timeout)
    return p


def model_info(target: str):
    from clients import Client

    with Client(target, timeout=30, wait_for_ready=True) as c:
        return c.model_info()


# ---- report -----------------------------------------------------------------------------

def table(results: list[PolicyResult]) -> str:
    rows = ["| policy | requests | prompt tokens | prefix-cache hit rate | TTFT p50 (ms) | "
            "TTFT p99 (ms) | output tok/s | requests per engine | errors |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        prompt = sum(t.prompt_tokens for t in r.turns)
        rows.append(f"| {r.policy} | {len(r.turns)} | {prompt} | {r.hit_rate:.3f} | "
                    f"{r.ttft_p50 * 1e3:.1f} | {r.ttft_p99 * 1e3:.1f} | {r.throughput:.1f} | "
                    f"{' / '.join(map(str, r.per_engine()))} | {len(r.errors)} |")
    return "\n".join(rows)


def comparison(results: list[PolicyResult]) -> str | None:
    """prefix against round-robin: hit-rate ratio and TTFT p50 ratio."""
    by = {r.policy: r for r in results}
    if "prefix" not in by or "round-robin" not in by:
        return None
    p, rr = by["prefix"], by["round-robin"]
    ratio = p.hit_rate / rr.hit_rate if rr.hit_rate else float("inf")
    return (f"prefix vs round-robin: hit rate {ratio:.2f}x ({p.hit_rate:.3f} vs "
            f"{rr.hit_rate:.3f}), TTFT p50 {p.ttft_p50 * 1e3:.1f} vs {rr.ttft_p50 * 1e3:.1f} ms")


# ---- command line -----------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    where = parser.add_argument_group("engines (give --model or --engine)")
    where.add_argument("--model", default=None, metavar="DIR",
                       help="start --num-engines engines on this model, fresh for each policy")
    where.add_argument("--engine", action="append", default=[], metavar="HOST:PORT",
                       help="an engine already running; repeat for more (caches stay warm: "
                            "token ids are shifted per policy)")
    where.add_argument("--num-engines", type=int, default=3)
    where.add_argument("--device", default="cpu", help="engines' --device")
    where.add_argument("--dtype", default=None, help="engines' --dtype")
    where.add_argument("--num-kv-blocks", type=int, default=None, help="engines' KV blocks")
    where.add_argument("--kv-block-size", type=int, default=None)
    where.add_argument("--max-num-batched-tokens", type=int, default=None)
    where.add_argument("--max-num-seqs", type=int, default=None)
    where.add_argument("--max-model-len", type=int, default=None)
    where.add_argument("--engine-devices", default=None, metavar="0,1,2",
                       help="CUDA_VISIBLE_DEVICES of engine i = item i (mod the list)")
    where.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                       help="extra engine flag, e.g. --engine-arg=--enforce-eager")
    where.add_argument("--start-timeout", type=float, default=180.0, metavar="S")
    router = parser.add_argument_group("routers (one per policy)")
    router.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated, run in this order")
    router.add_argument("--cache-weight", type=float, default=None, help="None: router default")
    router.add_argument("--load-guard-ratio", type=float, default=None)
    router.add_argument("--load-guard-min", type=float, default=None)
    router.add_argument("--router-arg", action="append", default=[], metavar="FLAG",
                        help="extra router flag")
    load = parser.add_argument_group("workload")
    load.add_argument("--tenants", type=int, default=6)
    load.add_argument("--system-prompt-len", type=int, default=256, metavar="TOKENS")
    load.add_argument("--conversations-per-tenant", type=int, default=6)
    load.add_argument("--turns", type=int, default=4)
    load.add_argument("--user-message-len", type=int, default=32, metavar="TOKENS")
    load.add_argument("--max-tokens", type=int, default=16, help="reply length (ignore_eos)")
    load.add_argument("--rate", type=float, default=2.0,
                      help="conversations started per second (Poisson); <= 0: all at once")
    load.add_argument("--think-time", type=float, default=2.0, metavar="S",
                      help="mean pause (exponential) between a reply and the next turn")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--request-timeout", type=float, default=300.0, metavar="S")
    parser.add_argument("--no-record", action="store_true", help="do not log the figures")


def _workload(args: argparse.Namespace, vocab: int) -> Workload:
    return make_workload(args.tenants, args.conversations_per_tenant, args.turns,
                         args.system_prompt_len, args.user_message_len, args.max_tokens,
                         args.rate, args.seed, min(vocab, 10000), args.think_time)


def _show_warnings(policy: str, procs: list[ServerProc], limit: int = 10) -> None:
    """Health flaps and failures change where requests go: say so next to the figures."""
    found = [f"{p.name}: {line.rstrip()}" for p in procs for line in list(p.lines)
             if " WARNING " in line or " ERROR " in line]
    for line in found[:limit]:
        print(f"[{policy}] {line}", file=sys.stderr)
    if len(found) > limit:
        print(f"[{policy}] ... {len(found) - limit} more warnings", file=sys.stderr)


def _one_policy(args: argparse.Namespace, policy: str, index: int,
                base: Workload | None) -> tuple[PolicyResult, Workload]:
    with contextlib.ExitStack() as stack:
        procs: list[ServerProc] = []
        if args.model:
            print(f"[{policy}] starting {args.num_engines} fresh engines", flush=True)
            procs = start_engines(args, stack)
            engines = [p.target for p in procs]
        else:
            engines = list(args.engine)
        info = model_info(engines[0])
        vocab = min(info.vocab_size, 10000)
        base = base or _workload(args, info.vocab_size)
        if base.longest_sequence() > info.max_model_len:
            raise SystemExit(f"error: the longest conversation needs {base.longest_sequence()} "
                             f"tokens, the engines allow {info.max_model_len}")
        workload = base if args.model else base.shifted(index, vocab)
        router = start_router(args, engines, policy, stack)
        result = asyncio.run(run_policy(router.target, policy, workload, args.request_timeout))
        result.engine_order = engines
        _show_warnings(policy, [router, *procs])
    return result, base


def main(args: argparse.Namespace) -> int:
    if bool(args.model) == bool(args.engine):
        print("error: give either --model DIR or --engine HOST:PORT (repeatable)",
              file=sys.stderr)
        return 2
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        print(f"error: --policies takes some of {', '.join(POLICIES)}, got {args.policies!r}",
              file=sys.stderr)
        return 2
    if args.model and args.num_engines < 1:
        print("error: --num-engines must be >= 1", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the engines and routers this run started are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    results: list[PolicyResult] = []
    base: Workload | None = None
    for i, policy in enumerate(policies):
        result, base = _one_policy(args, policy, i, base)
        results.append(result)
        for e in result.errors[:3]:
            print(f"[{policy}] request failed: {e}", file=sys.stderr)
    num_engines = args.num_engines if args.model else len(args.engine)
    summary = (f"{args.tenants} tenants x {args.conversations_per_tenant} conversations x "
               f"{args.turns} turns = {base.num_requests} requests per policy; system prompt "
               f"{args.system_prompt_len} tokens, user messages {args.user_message_len}, "
               f"replies {args.max_tokens} (greedy); {args.rate} conversations/s (Poisson, "
               f"seed {args.seed}), think time {args.think_time} s; {num_engines} engines")
    text, versus = table(results), comparison(results)
    print(f"\n{summary}\n")
    print(text)
    if versus:
        print(f"\n{versus}")
    if not args.no_record:
        figures = {"workload": summary,
                   "engines": ("fresh engines per policy" if args.model else
                               "engines kept running; token ids shifted per policy")}
        if versus:
            figures["comparison"] = versus
        figures["table"] = "\n\n" + text
        record("routing policies, multi-tenant chat", figures)
    return 1 if any(r.errors for r in results) else 0
