"""`nanoserve bench routing`: the workload generator, and one tiny end-to-end run against
real engine and router processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.routing import POLICIES, make_workload

ROOT = Path(__file__).resolve().parent.parent


def test_workload_shape_and_poisson_starts():
    w = make_workload(tenants=3, conversations_per_tenant=400, turns=2, system_prompt_len=20,
                      user_message_len=5, max_tokens=4, rate=4.0, seed=1, vocab=300,
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
    again = make_workload(3, 400, 2, 20, 5, 4, 4.0, 1, 300, 0.5)
    assert again.system_prompts == w.system_prompts and again.conversations == w.conversations
    burst = make_workload(3, 2, 1, 20, 5, 4, 0.0, 1, 300)
    assert all(c.start == 0 and c.think_times == [] for c in burst.conversations)


def test_shifted_workload_keeps_its_shape():
    w = make_workload(2, 3, 2, 8, 3, 4, 1.0, 0, 50)
    s = w.shifted(7, 50)
    assert [[(t + 7) % 50 for t in p] for p in w.system_prompts] == s.system_prompts
    for a, b in zip(w.conversations, s.conversations, strict=True):
        assert (a.tenant, a.start) == (b.tenant, b.start)
        assert [[(t + 7) % 50 for t in m] for m in a.user_messages] == b.user_messages


def _parse_table(stdout: str) -> list[dict[str, str]]:
    lines = [x for x in stdout.splitlines() if x.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in x.strip("|").split("|")] for x in lines[2:]]
    return [dict(zip(header, row, strict=True)) for row in rows]


@pytest.mark.timeout(120)
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
           "--no-record"]
    env = {**os.environ, "NANOSERVE_RESULTS": str(results)}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=100)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the benchmark stops the engines and routers it started
        stdout, stderr = proc.communicate(timeout=60)
    out = stdout[-3000:] + stderr[-3000:]
    assert proc.returncode == 0, out
    rows = _parse_table(stdout)
    assert [r["policy"] for r in rows] == list(POLICIES)
    requests = tenants * convs * turns
    # turn k's prompt: system + k user messages + (k - 1) replies
    prompt_tokens = tenants * convs * sum(system + k * user + (k - 1) * reply
                                          for k in range(1, turns + 1))
    for r in rows:
        assert int(r["requests"]) == requests and int(r["errors"]) == 0, out
        assert int(r["prompt tokens"]) == prompt_tokens, out  # as the engines counted them
        assert 0.0 <= float(r["prefix-cache hit rate"]) <= 1.0, out
        p50, p99 = float(r["TTFT p50 (ms)"]), float(r["TTFT p99 (ms)"])
        assert 0 < p50 <= p99, out
        assert float(r["output tok/s"]) > 0, out
        per_engine = [int(x) for x in r["requests per engine"].split("/")]
        assert len(per_engine) == 2 and sum(per_engine) == requests, out
    # a tenant's later turns and conversations reuse its system prompt on its engine
    assert float(rows[0]["prefix-cache hit rate"]) > 0, out
    assert not results.exists()  # --no-record
