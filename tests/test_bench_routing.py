"""`nanoserve bench routing`: the workload generator, the oracle's choice (pure, then against
fake engines), the gRPC and OpenAI HTTP senders against one real engine, the report table,
and one tiny end-to-end run against real engine and router processes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.routing import (
    PolicyResult,
    comparison,
    make_workload,
    parse_table,
    replay,
    table,
)
from benchmarks.routing_oracle import EngineView, Oracle, choose
from benchmarks.routing_senders import (
    Reply,
    grpc_sender,
    http_sender,
    requests_served,
    served_model,
)
from engine_service.common.block_hash import hash_prompt_blocks
from nanoserve.v1 import nanoserve_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent


def test_workload_shape_and_poisson_starts():
    w = make_workload(tenants=3, conversations_per_tenant=400, turns=2, system_prompt_len=20,
                      user_message_len=5, max_tokens=4, rate=4.0, seed=1, tokens=range(300),
                      think_time=0.5)
    assert len(w.system_prompts) == 3 and all(len(p) == 20 for p in w.system_prompts)
    assert len({tuple(p) for p in w.system_prompts}) == 3
    assert sorted(c.tenant for c in w.conversations) == sorted(list(range(3)) * 400)
    assert all(len(c.user_messages) == 2 and all(len(m) == 5 for m in c.user_messages)
               for c in w.conversations)
    assert all(0 <= t < 300 for p in w.system_prompts for t in p)
    starts = [c.start for c in w.conversations]
    assert starts[0] == 0 and starts == sorted(starts)
    gaps = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    mean = sum(gaps) / len(gaps)
    assert 0.2 < mean < 0.3  # exponential gaps, mean 1/rate = 0.25 s over 1199 draws
    thinks = [t for c in w.conversations for t in c.think_times]
    assert len(thinks) == 1200 and 0.45 < sum(thinks) / len(thinks) < 0.55
    # tenants are interleaved, not one after another
    assert len({c.tenant for c in w.conversations[:20]}) == 3
    assert w.num_requests == 3 * 400 * 2
    assert w.longest_sequence() == 20 + 2 * (5 + 4)
    # same seed, same workload; rate <= 0 starts everything at once
    again = make_workload(3, 400, 2, 20, 5, 4, 4.0, 1, range(300), 0.5)
    assert again.system_prompts == w.system_prompts and again.conversations == w.conversations
    burst = make_workload(3, 2, 1, 20, 5, 4, 0.0, 1, range(300))
    assert all(c.start == 0 and c.think_times == [] for c in burst.conversations)
    with pytest.raises(ValueError, match="max_tokens"):
        make_workload(3, 2, 1, 20, 5, 0, 0.0, 1, range(300))


def test_replay_spreads_turns_over_replicas_and_builds_history():
    w = make_workload(tenants=2, conversations_per_tenant=2, turns=3, system_prompt_len=5,
                      user_message_len=2, max_tokens=3, rate=0, seed=3, tokens=range(50))
    seen: list[tuple[int, list[int]]] = []  # (sender, prompt) of every turn

    def sender(k: int):
        async def send(prompt: list[int]) -> Reply:
            seen.append((k, prompt))
            if len(prompt) > 12:  # third turns (17 tokens) fail: their conversation ends
                raise RuntimeError("refused")
            return Reply([900 + k, 901, len(prompt)], 0.01, len(prompt), 0, 3, f"e{k}")
        return send

    result = asyncio.run(replay("test", w, [sender(0), sender(1)]))
    assert len(result.turns) == 8 and len(result.errors) == 4
    by_prompt = {tuple(p): k for k, p in seen}
    for i, conv in enumerate(w.conversations):
        history = w.system_prompts[conv.tenant]
        for j, user in enumerate(conv.user_messages):
            prompt = history + user
            assert by_prompt[tuple(prompt)] == (i + j) % 2  # turn j of conversation i
            history = prompt + [900 + (i + j) % 2, 901, len(prompt)]  # the reply's token ids


# ---- the oracle -------------------------------------------------------------------------

def test_oracle_choice_longest_cached_prefix_then_load_then_index():
    prompt = list(range(40))
    h4 = hash_prompt_blocks(prompt, 4)  # 10 blocks
    views = [EngineView(h4[:2], 4, 0), EngineView(h4[:5] + [123], 4, 100),
             EngineView(list(reversed(h4[:5])), 4, 50)]
    assert choose(prompt, views) == (2, 20)  # 5 blocks each; engine 2 has less in flight
    # a missing block ends the match, whatever follows it
    assert choose(prompt, [EngineView([h4[0], h4[1], h4[3], h4[4]], 4, 0),
                           EngineView(h4[:3], 4, 9)]) == (1, 12)
    # another prompt's blocks are no match, nor are this prompt's blocks from elsewhere
    other = hash_prompt_blocks([7] + prompt[1:], 4)
    assert choose(prompt, [EngineView(other, 4, 0), EngineView(h4[1:], 4, 1)]) == (0, 0)
    # nothing cached anywhere: least in flight, then the lowest index
    assert choose(prompt, [EngineView([], 4, 5), EngineView([], 4, 3),
                           EngineView([], 4, 3)]) == (1, 0)
    # each engine is matched in its own block size
    h8 = hash_prompt_blocks(prompt, 8)
    assert choose(prompt, [EngineView(h4[:3], 4, 0), EngineView(h8[:2], 8, 0)]) == (1, 16)


def test_oracle_reads_fake_engines_and_sends_to_the_best():
    from tests.fake_engine import FakeBehavior, start_fake_engine

    fakes = [start_fake_engine(engine_id=f"e{i}", behavior=FakeBehavior(
        kv_block_size=4, load=pb.Load(tokens_in_flight=t, accepting=True)))
        for i, t in enumerate((7, 3, 3))]
    try:
        prompt = list(range(100, 124))  # 6 blocks of 4
        hashes = hash_prompt_blocks(prompt, 4)
        fakes[0][0].store_blocks(hashes[:4])
        fakes[1][0].store_blocks(hashes[:2])
        fakes[2][0].store_blocks(hashes[1:5])  # no first block: no prefix

        async def turns() -> list[Reply]:
            async with Oracle([f"127.0.0.1:{port}" for _, port in fakes], 3, 10) as oracle:
                return [await oracle.send(p) for p in (prompt, list(range(500, 520)))]

        first, elsewhere = asyncio.run(turns())
        assert first.engine_id == "e0" and first.cached_prompt_tokens == 16
        assert first.token_ids == [124, 125, 126]  # the fake's next tokens
        assert elsewhere.engine_id == "e1" and elsewhere.cached_prompt_tokens == 0  # less load
        assert [len(f.requests) for f, _ in fakes] == [1, 1, 0]
    finally:
        for fake, _ in fakes:
            fake.stop()


# ---- senders against a real engine ------------------------------------------------------

@pytest.mark.timeout(90)
def test_grpc_and_http_senders_agree_on_a_real_engine(tiny_model_dir):
    import aiohttp

    from clients import AsyncClient
    from tests.procs import start_engine

    engine = start_engine(tiny_model_dir, "--http-port", "0")
    try:
        scheme, port = engine.http_address()
        base = f"{scheme}://127.0.0.1:{port}"
        model = served_model(base)
        prompt = list(range(1, 41))

        async def turns() -> tuple[Reply, Reply, EngineView]:
            async with AsyncClient(engine.target) as client, \
                    aiohttp.ClientSession(base) as http:
                by_grpc = await grpc_sender(client, 6, 60)(prompt)
                by_http = await http_sender(http, model, 6)(prompt)
            async with Oracle([engine.target], 6, 30) as oracle:
                return by_grpc, by_http, await oracle.view(0)

        by_grpc, by_http, view = asyncio.run(turns())
        assert len(by_grpc.token_ids) == 6 and by_http.token_ids == by_grpc.token_ids
        assert by_grpc.prompt_tokens == by_http.prompt_tokens == 40
        assert by_grpc.completion_tokens == by_http.completion_tokens == 6
        assert by_http.ttft > 0 and by_grpc.ttft > 0
        # the second send finds the first one's full blocks in the cache
        full = 40 // view.block_size * view.block_size
        assert by_grpc.cached_prompt_tokens == 0 and by_http.cached_prompt_tokens == full > 0
        assert by_grpc.engine_id == engine.target and by_http.engine_id == ""
        # the oracle sees the engine's true cache, hashed as the router hashes
        assert set(hash_prompt_blocks(prompt, view.block_size)) <= set(view.hashes)
        assert requests_served(base) == 2
    finally:
        engine.stop()


# ---- report -----------------------------------------------------------------------------

def _run(policy: str, routers: str, cached: int, ttfts: list[float]) -> PolicyResult:
    turns = [Reply([1], t, 100, cached, 4, "") for t in ttfts]
    return PolicyResult(policy, routers, turns, seconds=2.0, engine_requests=[len(turns), 0])


def test_table_ratios_percentiles_and_an_unavailable_route():
    results = [_run("prefix", "1", 50, [0.1, 0.3, 0.2]), _run("prefix", "2", 25, [0.4]),
               _run("round-robin", "1", 20, [0.5]), _run("oracle", "-", 80, [0.2]),
               PolicyResult("sglang", "1", unavailable="no | gateway\nhere")]
    rows = parse_table(table(results))
    assert [(r["policy"], r["routers"]) for r in rows][:4] == [
        ("prefix", "1"), ("prefix", "2"), ("round-robin", "1"), ("oracle", "-")]
    assert [r["hit rate / oracle"] for r in rows[:4]] == ["0.62", "0.31", "0.25", "1.00"]
    assert [r["hit rate / 1 router"] for r in rows[:4]] == ["-", "0.50", "-", "-"]
    assert (rows[0]["TTFT p50 (ms)"], rows[0]["TTFT p90 (ms)"], rows[0]["TTFT p99 (ms)"]) == (
        "200.0", "300.0", "300.0")
    assert rows[0]["requests per engine"] == "3 / 0" and rows[0]["output tok/s"] == "6.0"
    assert rows[4]["routers"] == "unavailable: no / gateway here"
    assert set(list(rows[4].values())[2:]) == {"-"}
    assert comparison(results) == ("prefix vs round-robin: hit rate 2.50x (0.500 vs 0.200), "
                                   "TTFT p50 200.0 vs 500.0 ms")
    # no oracle and one router each: no ratio columns
    plain = parse_table(table(results[:1] + results[2:3]))
    assert "hit rate / oracle" not in plain[0] and "hit rate / 1 router" not in plain[0]


# ---- end to end -------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_bench_routing_end_to_end(tiny_model_dir, tmp_path):
    results = tmp_path / "RESULTS.md"
    system, user, reply, turns, tenants, convs = 64, 32, 8, 2, 2, 2
    cmd = [sys.executable, "-m", "clients.cli", "bench", "routing",
           "--model", str(tiny_model_dir), "--num-engines", "2", "--dtype", "float32",
           "--num-kv-blocks", "64", "--max-model-len", "512",
           "--max-num-batched-tokens", "128", "--tenants", str(tenants),
           "--conversations-per-tenant", str(convs), "--turns", str(turns),
           "--system-prompt-len", str(system), "--user-message-len", str(user),
           "--max-tokens", str(reply), "--rate", "20", "--think-time", "0.2",
           "--policies", "prefix,prefix@http,oracle,sglang", "--router-replicas", "2",
           "--no-record"]
    env = {**os.environ, "NANOSERVE_RESULTS": str(results)}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=130)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the benchmark stops the engines and routers it started
        stdout, stderr = proc.communicate(timeout=60)
    out = stdout[-3000:] + stderr[-3000:]
    assert proc.returncode == 0, out
    rows = {r["policy"]: r for r in parse_table(stdout)}
    assert list(rows) == ["prefix", "prefix@http", "oracle", "sglang"], out
    assert [rows[p]["routers"] for p in ("prefix", "prefix@http", "oracle")] == ["2", "2", "-"]
    ran = [p for p, r in rows.items() if not r["routers"].startswith("unavailable: ")]
    requests = tenants * convs * turns
    # turn k's prompt: system + k user messages + (k - 1) replies
    prompt_tokens = tenants * convs * sum(system + k * user + (k - 1) * reply
                                          for k in range(1, turns + 1))
    for policy in ran:
        r = rows[policy]
        assert int(r["requests"]) == requests and int(r["errors"]) == 0, out
        if policy in ("prefix", "oracle"):  # token ids: the engines count exactly these
            assert int(r["prompt tokens"]) == prompt_tokens, out
        else:  # text: system prompts and user messages read back as the same ids; replies
            # (any token a random model draws) may not
            assert int(r["prompt tokens"]) >= tenants * convs * turns * (system + user), out
        assert 0.0 < float(r["prefix-cache hit rate"]) <= 1.0, out
        p50, p90, p99 = (float(r[f"TTFT p{q} (ms)"]) for q in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99, out
        assert float(r["output tok/s"]) > 0, out
        per_engine = [int(x) for x in r["requests per engine"].split("/")]  # engines' /metrics
        assert len(per_engine) == 2 and sum(per_engine) == requests, out
    assert rows["oracle"]["hit rate / oracle"] == "1.00", out
    assert not results.exists()  # --no-record
