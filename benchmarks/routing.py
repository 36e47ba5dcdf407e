"""`nanoserve bench routing`: one multi-tenant chat workload replayed under each route, on
fresh engines each run (restarting them is the simplest way to empty their prefix caches):
prefix-cache hit rate, TTFT p50/p90/p99, output tok/s and requests per engine (the engines'
own /metrics counts). Think time keeps many tenants' conversations open at once, as in a real
chat service. Routes: the router's policies (through N replicas; POLICY@http: as text through
its OpenAI front), `oracle` (benchmarks/routing_oracle.py) and `sglang`
(benchmarks/sglang_gateway.py, text only). With a text route in the run, every route's
workload is drawn from `text_safe_tokens`, so all routes send the engines the same prompts.
Torch-free: it only starts processes and talks gRPC and HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

from tqdm.auto import tqdm

from benchmarks.procs import ServerProc, start_engines, start_routers, threads_each
from benchmarks.results import percentile, record
from benchmarks.routing_oracle import Oracle
from benchmarks.routing_senders import (
    Reply,
    Send,
    grpc_sender,
    http_sender,
    requests_served,
    served_model,
    text_safe_tokens,
)
from router.policy import POLICIES

ROUTES = ("oracle", "sglang")  # routes of the benchmark's own, beside the router's policies
HTTP = "@http"  # "prefix@http": the router's policy, turns as text through its OpenAI front


def is_text_route(route: str) -> bool:
    """Routes whose turns go as text over OpenAI HTTP (SGLang's gateway takes no token ids)."""
    return route == "sglang" or route.endswith(HTTP)


# ---- workload ---------------------------------------------------------------------------

@dataclass
class Conversation:
    tenant: int
    start: float                    # seconds after the run starts
    user_messages: list[list[int]]  # one per turn
    think_times: list[float]        # pause before turn i + 1, after turn i has finished


@dataclass
class Workload:
    system_prompts: list[list[int]]  # one per tenant
    conversations: list[Conversation]
    max_tokens: int

    @property
    def num_requests(self) -> int:
        return sum(len(c.user_messages) for c in self.conversations)

    def longest_sequence(self) -> int:
        """Tokens of the longest turn's prompt plus its reply."""
        return max(len(self.system_prompts[c.tenant])
                   + sum(len(m) + self.max_tokens for m in c.user_messages)
                   for c in self.conversations)


def make_workload(tenants: int, conversations_per_tenant: int, turns: int,
                  system_prompt_len: int, user_message_len: int, max_tokens: int,
                  rate: float, seed: int, tokens: Sequence[int],
                  think_time: float = 0.0) -> Workload:
    """Token ids drawn at random from `tokens`; conversation starts at Poisson times (rate
    <= 0: all at t=0) in a shuffled order of tenants; think times exponential with mean
    `think_time` (0: none), drawn here so every policy waits the same."""
    for name, value in (("tenants", tenants), ("conversations_per_tenant",
                        conversations_per_tenant), ("turns", turns),
                        ("system_prompt_len", system_prompt_len),
                        ("user_message_len", user_message_len), ("max_tokens", max_tokens)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not tokens:
        raise ValueError("tokens must not be empty")
    rng = random.Random(seed)
    ids = lambda n: [rng.choice(tokens) for _ in range(n)]
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


# ---- one run ----------------------------------------------------------------------------

@dataclass
class PolicyResult:
    policy: str
    routers: str  # router processes: "1", "3"; "-" for the oracle (no router)
    turns: list[Reply] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    engine_requests: list[int] = field(default_factory=list)  # each engine's own count
    unavailable: str | None = None  # why this route could not run

    @property
    def hit_rate(self) -> float:
        prompt = sum(t.prompt_tokens for t in self.turns)
        return sum(t.cached_prompt_tokens for t in self.turns) / prompt if prompt else 0.0

    def ttft(self, q: float) -> float:
        """TTFT percentile `q` in seconds (nearest rank, as p50, p90 and p99 alike)."""
        return percentile([t.ttft for t in self.turns], q)

    @property
    def throughput(self) -> float:
        return sum(t.completion_tokens for t in self.turns) / self.seconds if self.seconds else 0.0


async def _conversation(senders: Sequence[Send], workload: Workload, number: int,
                        conv: Conversation, t0: float, bar, out: list[Reply],
                        errors: list[str]) -> None:
    """Conversation `number`'s turns; turn j goes through senders[(number + j) % len]."""
    await asyncio.sleep(max(0.0, t0 + conv.start - time.perf_counter()))
    history = list(workload.system_prompts[conv.tenant])
    for turn, user in enumerate(conv.user_messages):
        if turn:
            await asyncio.sleep(conv.think_times[turn - 1])
        prompt = history + user
        try:
            reply = await senders[(number + turn) % len(senders)](prompt)
        except Exception as e:  # a failed turn ends its conversation: no reply to build on
            errors.append(f"{type(e).__name__}: {e}")
            bar.update(len(conv.user_messages) - turn)
            return
        out.append(reply)
        history = prompt + reply.token_ids
        bar.update(1)


async def replay(label: str, workload: Workload, senders: Sequence[Send]) -> PolicyResult:
    """Every conversation of `workload` through `senders`, on the workload's schedule."""
    result = PolicyResult(label, "")
    bar = tqdm(total=workload.num_requests, desc=f"{label:>15}", dynamic_ncols=True)
    t0 = time.perf_counter()
    await asyncio.gather(*(_conversation(senders, workload, i, c, t0, bar, result.turns,
                                         result.errors)
                           for i, c in enumerate(workload.conversations)))
    result.seconds = time.perf_counter() - t0
    bar.close()
    return result


@dataclass
class Route:
    policy: str          # a router policy (maybe @http), "oracle" or "sglang"
    targets: list[str]   # router replicas (gRPC or base URLs), engines (oracle), the gateway
    model: str = ""      # served model name, for OpenAI HTTP
    decode: Callable[[list[int]], str] | None = None  # token ids -> prompt text (text routes)


async def run_route(route: Route, workload: Workload, timeout: float,
                    label: str = "") -> PolicyResult:
    """Open the route's clients and replay `workload` through them."""
    from clients import AsyncClient

    async with contextlib.AsyncExitStack() as stack:
        if route.policy == "oracle":
            oracle = Oracle(route.targets, workload.max_tokens, timeout)
            senders = [(await stack.enter_async_context(oracle)).send]
        elif is_text_route(route.policy):
            import aiohttp

            sessions = [await stack.enter_async_context(aiohttp.ClientSession(
                t, connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(total=timeout))) for t in route.targets]
            senders = [http_sender(c, route.model, workload.max_tokens, route.decode)
                       for c in sessions]
        else:
            clients = [await stack.enter_async_context(AsyncClient(t)) for t in route.targets]
            senders = [grpc_sender(c, workload.max_tokens, timeout) for c in clients]
        result = await replay(label or route.policy, workload, senders)
    result.policy = route.policy
    return result


# ---- processes --------------------------------------------------------------------------

class RouteUnavailable(RuntimeError):
    """A route that cannot run here; its row says why."""


def _flags(args: argparse.Namespace, *names: str) -> list[str]:
    """`--name value` for each of `names` that `args` sets."""
    return [x for name in names if (value := getattr(args, name)) is not None
            for x in ("--" + name.replace("_", "-"), str(value))]


def start_fleet(args: argparse.Namespace, policy: str, routers: int,
                stack: contextlib.ExitStack) -> tuple[list[ServerProc], list[ServerProc]]:
    """`--num-engines` fresh engines (OpenAI HTTP front on, for the gateway and /metrics) and,
    for a router policy, `routers` routers over them, each router once every engine serves in
    its pool; all stopped when `stack` closes."""
    flags = _flags(args, "dtype", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs",
                   "kv_block_size", "max_model_len")
    devices = args.engine_devices.split(",") if args.engine_devices else []
    env = lambda i: threads_each(args.num_engines) | (
        {"CUDA_VISIBLE_DEVICES": devices[i % len(devices)]} if devices else {})
    engines = start_engines(args.model, "--http-port", "0", "--device", args.device, *flags,
                            *args.engine_arg, n=args.num_engines, timeout=args.start_timeout,
                            env=env, max_lines=400, stack=stack)
    if policy in ROUTES:
        return engines, []
    flags = _flags(args, "cache_weight", "load_guard_ratio", "load_guard_min")
    return engines, start_routers([p.target for p in engines], "--policy",
                                  policy.removesuffix(HTTP), *flags, *args.router_arg, n=routers,
                                  timeout=args.start_timeout, serving=True, max_lines=400,
                                  stack=stack)


def sglang_gateway() -> ModuleType:
    """benchmarks.sglang_gateway, checked before any engine starts for it."""
    try:
        from benchmarks import sglang_gateway as gateway
    except ImportError as e:
        raise RouteUnavailable(f"benchmarks.sglang_gateway cannot be imported: {e}") from None
    return gateway


def start_sglang(gateway: ModuleType, http_urls: list[str], stack: contextlib.ExitStack,
                 timeout: float) -> str:
    """SGLang's gateway over the engines' HTTP fronts: its base URL."""
    try:
        return "http://" + gateway.start_gateway(http_urls, stack, timeout)
    except gateway.GatewayUnavailable as e:
        raise RouteUnavailable(str(e)) from None


def _http_url(proc: ServerProc) -> str:
    scheme, port = proc.http_address()
    return f"{scheme}://127.0.0.1:{port}"


def _tokenizer_json(args: argparse.Namespace) -> str:
    """The model directory's tokenizer, which text routes need to write prompts as text."""
    path = os.path.join(args.model, "tokenizer.json")
    if not os.path.isfile(path):
        raise RouteUnavailable("text routes need --model DIR with a tokenizer.json")
    return path


def model_info(target: str):
    from clients import Client

    with Client(target, timeout=30, wait_for_ready=True) as c:
        return c.model_info()


def engine_counts(http_urls: list[str]) -> list[int]:
    return [requests_served(u) for u in http_urls]


def counts_since(http_urls: list[str], before: list[int], expected: int,
                 wait: float = 5.0) -> list[int]:
    """Requests each engine finished since `before`; waits (up to `wait` s) for the counts
    to reach `expected`, as an engine may count a request just after its last chunk left."""
    deadline = time.monotonic() + wait
    while True:
        counts = [after - b for after, b in zip(engine_counts(http_urls), before, strict=True)]
        if sum(counts) >= expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


# ---- report -----------------------------------------------------------------------------

def _ratio(a: float, b: float | None) -> str:
    return "-" if not b else f"{a / b:.2f}"


def table(results: list[PolicyResult]) -> str:
    """One row per run. `hit rate / oracle` when the oracle ran; `hit rate / 1 router`
    (the same policy's hit rate at one router) when some run had more than one."""
    oracle = next((r.hit_rate for r in results if r.policy == "oracle" and r.turns), None)
    single = {r.policy: r.hit_rate for r in results if r.routers == "1" and r.turns}
    replicas = any(r.routers not in ("1", "-") for r in results if not r.unavailable)
    header = ["policy", "routers", "requests", "prompt tokens", "prefix-cache hit rate"]
    header += ["hit rate / oracle"] * (oracle is not None)
    header += ["hit rate / 1 router"] * replicas
    header += ["TTFT p50 (ms)", "TTFT p90 (ms)", "TTFT p99 (ms)", "output tok/s",
               "requests per engine", "errors"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        if r.unavailable:
            reason = " ".join(r.unavailable.split()).replace("|", "/")
            cells = [r.policy, f"unavailable: {reason}"] + ["-"] * (len(header) - 2)
        else:
            cells = [r.policy, r.routers, str(len(r.turns)),
                     str(sum(t.prompt_tokens for t in r.turns)), f"{r.hit_rate:.3f}"]
            cells += [_ratio(r.hit_rate, oracle)] * (oracle is not None)
            cells += [_ratio(r.hit_rate, single.get(r.policy))
                      if r.routers not in ("1", "-") else "-"] * replicas
            cells += [f"{r.ttft(q) * 1e3:.1f}" for q in (50, 90, 99)]
            cells += [f"{r.throughput:.1f}", " / ".join(map(str, r.engine_requests)),
                      str(len(r.errors))]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of the table `table()` printed into `text`, keyed by its header."""
    lines = [x for x in text.splitlines() if x.startswith("| ")]
    if not lines:
        return []
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in x.strip("|").split("|")), strict=True))
            for x in lines[1:]]


def comparison(results: list[PolicyResult]) -> str | None:
    """prefix against round-robin (each at its fewest routers): hit-rate ratio and TTFT p50."""
    def first(policy: str) -> PolicyResult | None:
        runs = [r for r in results if r.policy == policy and not r.unavailable]
        return min(runs, key=lambda r: int(r.routers), default=None)

    p, rr = first("prefix"), first("round-robin")
    if p is None or rr is None:
        return None
    ratio = p.hit_rate / rr.hit_rate if rr.hit_rate else float("inf")
    return (f"prefix vs round-robin: hit rate {ratio:.2f}x ({p.hit_rate:.3f} vs "
            f"{rr.hit_rate:.3f}), TTFT p50 {p.ttft(50) * 1e3:.1f} vs {rr.ttft(50) * 1e3:.1f} ms")


# ---- command line -----------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    where = parser.add_argument_group("engines")
    where.add_argument("--model", required=True, metavar="DIR",
                       help="start --num-engines engines on this model, fresh for each run")
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
    router = parser.add_argument_group("routes")
    router.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma-separated, run in this order: router policies "
                             f"({', '.join(POLICIES)}; POLICY{HTTP}: turns as text through "
                             "the router's OpenAI front), oracle (each turn to the engine "
                             "caching most of it) or sglang (SGLang's gateway, text)")
    router.add_argument("--router-replicas", default="1", metavar="N,N",
                        help="router processes per run, comma-separated: one run per count "
                             "for each router policy")
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


def _workload(args: argparse.Namespace, vocab: int, text: bool) -> Workload:
    """With text routes, token ids that read back as themselves from their text, so every
    route sends the engines the same tokens; else any of the first 10,000 ids."""
    tokens = text_safe_tokens(_tokenizer_json(args)) if text else range(min(vocab, 10000))
    return make_workload(args.tenants, args.conversations_per_tenant, args.turns,
                         args.system_prompt_len, args.user_message_len, args.max_tokens,
                         args.rate, args.seed, tokens, args.think_time)


def _show_warnings(label: str, procs: list[ServerProc], limit: int = 10) -> None:
    """Health flaps and failures change where requests go: say so next to the figures."""
    found = [f"{p.name}: {line.rstrip()}" for p in procs for line in list(p.lines)
             if " WARNING " in line or " ERROR " in line]
    for line in found[:limit]:
        print(f"[{label}] {line}", file=sys.stderr)
    if len(found) > limit:
        print(f"[{label}] ... {len(found) - limit} more warnings", file=sys.stderr)


def _one_run(args: argparse.Namespace, policy: str, routers: int, base: Workload | None,
             text: bool) -> tuple[PolicyResult, Workload | None]:
    """One route on fresh engines; a route that cannot run here comes back as a row saying
    why."""
    label = policy if policy in ROUTES else f"{policy} x{routers}"
    try:
        gateway = sglang_gateway() if policy == "sglang" else None
        return _run_on_engines(args, policy, routers, base, label, gateway, text)
    except RouteUnavailable as e:
        print(f"[{label}] unavailable: {e}", file=sys.stderr)
        return PolicyResult(policy, "1", unavailable=str(e)), base


def _run_on_engines(args: argparse.Namespace, policy: str, routers: int,
                    base: Workload | None, label: str, gateway: ModuleType | None,
                    text: bool) -> tuple[PolicyResult, Workload]:
    with contextlib.ExitStack() as stack:
        print(f"[{label}] starting {args.num_engines} fresh engines", flush=True)
        procs, route_procs = start_fleet(args, policy, routers, stack)
        engines = [p.target for p in procs]
        http_urls = [_http_url(p) for p in procs]
        info = model_info(engines[0])
        workload = base or _workload(args, info.vocab_size, text)
        if workload.longest_sequence() > info.max_model_len:
            raise SystemExit(f"error: the longest conversation needs "
                             f"{workload.longest_sequence()} tokens, the engines allow "
                             f"{info.max_model_len}")
        if policy == "oracle":
            route = Route(policy, engines)
        elif policy == "sglang":
            gateway_url = start_sglang(gateway, http_urls, stack, args.start_timeout)
            route = Route(policy, [gateway_url], served_model(http_urls[0]))
        elif is_text_route(policy):
            urls = [_http_url(p) for p in route_procs]
            route = Route(policy, urls, served_model(urls[0]))
        else:
            route = Route(policy, [p.target for p in route_procs])
        if is_text_route(policy):
            from tokenizers import Tokenizer

            route.decode = Tokenizer.from_file(_tokenizer_json(args)).decode
        before = engine_counts(http_urls)
        result = asyncio.run(run_route(route, workload, args.request_timeout, label))
        if policy == "sglang" and result.errors and not result.turns:
            # A gateway that refuses this workload outright (say, its token-id prompts) is
            # a finding about the gateway, not a failed run.
            raise RouteUnavailable(f"the gateway failed every turn: {result.errors[0]}")
        result.routers = "-" if policy == "oracle" else str(routers)
        result.engine_requests = counts_since(http_urls, before, len(result.turns))
        _show_warnings(label, [*route_procs, *procs])
    return result, workload


def _parse_replicas(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        raise ValueError(text)
    return counts


def main(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    known = (*POLICIES, *(p + HTTP for p in POLICIES), *ROUTES)
    unknown = sorted(set(policies) - set(known))
    if unknown or not policies:
        print(f"error: --policies takes some of {', '.join(known)}, got {args.policies!r}",
              file=sys.stderr)
        return 2
    try:
        replicas = _parse_replicas(args.router_replicas)
    except ValueError:
        print(f"error: --router-replicas takes counts >= 1 separated by commas, got "
              f"{args.router_replicas!r}", file=sys.stderr)
        return 2
    if args.num_engines < 1:
        print("error: --num-engines must be >= 1", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the engines and routers this run started are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    runs = [(p, n) for p in policies for n in ([1] if p in ROUTES else replicas)]
    results: list[PolicyResult] = []
    base: Workload | None = None
    as_text = any(is_text_route(p) for p in policies)
    if as_text:
        try:
            _tokenizer_json(args)
        except RouteUnavailable as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    for policy, routers in runs:
        result, base = _one_run(args, policy, routers, base, as_text)
        results.append(result)
        for e in result.errors[:3]:
            print(f"[{policy}] request failed: {e}", file=sys.stderr)
    requests = args.tenants * args.conversations_per_tenant * args.turns
    summary = (f"{args.tenants} tenants x {args.conversations_per_tenant} conversations x "
               f"{args.turns} turns = {requests} requests per run; system prompt "
               f"{args.system_prompt_len} tokens, user messages {args.user_message_len}, "
               f"replies {args.max_tokens} (greedy); {args.rate} conversations/s (Poisson, "
               f"seed {args.seed}), think time {args.think_time} s; {args.num_engines} fresh "
               f"engines per run; router replicas {args.router_replicas} (turn j of "
               f"conversation i through replica (i + j) mod N)")
    if any(r.policy == "sglang" and not r.unavailable for r in results):
        from benchmarks.sglang_gateway import gateway_version

        summary += (f"; sglang: sglang-router {gateway_version()}, cache_aware, default "
                    "thresholds")
    if as_text:
        summary += "; text routes send prompts as text, over OpenAI HTTP"
    text, versus = table(results), comparison(results)
    print(f"\n{summary}\n")
    print(text)
    if versus:
        print(f"\n{versus}")
    if not args.no_record:
        figures = {"workload": summary}
        if versus:
            figures["comparison"] = versus
        figures["table"] = "\n\n" + text
        record("routing policies, multi-tenant chat", figures)
    return 1 if any(r.errors for r in results) else 0
