"""Every GPU figure in one call: `python -m benchmarks.gpu_suite [--stages ...]`, the stages
being STAGES' keys (each function says what it runs). Logs go to $OUT (or ./.out), figures are
appended to .out/runs.md (NANOSERVE_RESULTS to redirect); a table is printed last.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.procs import NANOSERVE, cpu_seconds, start_engines, start_routers

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("OUT", ROOT / ".out"))
ROWS: list[tuple[str, str, str]] = []
# Run alone after the rest: their engines size the KV cache from the memory the GPUs have
# free, which pytest-xdist workers running beside them can take.
ALONE_GPU_TESTS = "tests/gpu/test_tp_gpu.py"


def sh(name: str, cmd: list[str], timeout: float) -> str:
    """Run a command, tee its output to OUT/name.log, return the output."""
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    (OUT / f"{name}.log").write_text(text)
    print(f"[{name}] rc={rc} in {time.perf_counter() - t0:.0f}s", flush=True)
    if rc != 0:
        print(text[-3000:], flush=True)
    return text


def nanoserve(*args: str) -> list[str]:
    return [*NANOSERVE, *args]


def _found(m: re.Match | None, unit: str, group: int = 1) -> str:
    return f"{m.group(group)} {unit}" if m else "FAILED"


def _decode_rate(text: str) -> re.Match | None:
    """The median line of a --repeats run, else the one run's."""
    return (re.search(r"median of \d+ runs: decode ([\d.]+) tok/s", text)
            or re.search(r"decode ([\d.]+) tok/s", text))


SINGLE = ("--single", "--max-input-len", "512", "--max-output-len", "512")


def _offline(name: str, label: str, *flags: str, timeout: float = 540,
             note: str | Callable[[str], str] = "") -> tuple[str, float | None]:
    """`nanoserve bench offline FLAGS`, logged as `name`; appends the row `label`: its
    throughput, or with --single its decode rate, and `note` (or note(output)). Returns the
    output and the rate (None if it failed)."""
    text = sh(name, nanoserve("bench", "offline", *flags), timeout)
    m = (_decode_rate(text) if "--single" in flags
         else re.search(r"Throughput: ([\d.]+) tok/s", text))
    ROWS.append((label, _found(m, "tok/s"), note(text) if callable(note) else note))
    return text, float(m.group(1)) if m else None


def _acceptance(text: str) -> str:
    acc = re.findall(r"acceptance ([\d.]+%)", text)
    return f"acceptance {acc[-1]}" if acc else ""


def stage_tests(args) -> None:
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    for name, cmd in (("gpu_tests", [*pytest, "tests/gpu", f"--ignore={ALONE_GPU_TESTS}",
                                     *args.pytest_args]),
                      ("gpu_tests_alone", [*pytest, ALONE_GPU_TESTS])):
        text = sh(name, cmd, timeout=540)
        m = re.search(r"((\d+ failed, )?\d+ passed[^\n]*)", text)
        ROWS.append((name.replace("gpu_tests", "tests/gpu").replace("_", " "),
                     m.group(1) if m else f"FAILED (see {name}.log)", "pytest"))


def stage_offline(args) -> None:
    text, _ = _offline("offline", "offline nano-vllm bench", "--model", args.model,
                       *args.engine_args, note="nano-vllm 20,400")
    m = re.search(r"(\d+) steps; host busy ([\d.]+) s \(([\d.]+) ms/step\), waiting on the "
                  r"device ([\d.]+) s, device busy ([\d.]+) s", text)
    if m:
        ROWS.append(("  host busy / waiting on device / device busy",
                     f"{m.group(2)} s ({m.group(3)} ms/step) / {m.group(4)} s / {m.group(5)} s",
                     f"{m.group(1)} steps"))


def stage_single(args) -> None:
    # Host-bound at ~0.9 ms a step, so runs spread by several percent: the median of three.
    _offline("single", "single request decode (512+512)", "--model", args.model, *SINGLE,
             "--repeats", "3", *args.engine_args, timeout=300, note="nano-vllm ~475")


def stage_serve(args) -> None:
    """The workload as concurrent streams through a router to one engine: gRPC, then the
    router's OpenAI HTTP front (to compare with the offline stage of the same run). Each
    front gets fresh processes, so its prompts meet an empty prefix cache, as offline."""
    for name, http in (("serve", False), ("serve_http", True)):
        _serve_once(args, name, http)


def _serve_once(args, name: str, http: bool) -> None:
    from clients import Client

    OUT.mkdir(parents=True, exist_ok=True)
    procs = []  # engine, router
    try:
        try:
            procs += start_engines(args.model_dir, "--load-format", "dummy", *args.engine_args,
                                   timeout=240)
            procs += start_routers([procs[0].target], timeout=60)
            engine, router = procs
            target = ([f"127.0.0.1:{router.http_address()[1]}", "--http"] if http
                      else [router.target])
            with Client(engine.target) as client:
                vocab = str(client.model_info().vocab_size)
        except RuntimeError as e:
            (OUT / f"{name}_start.log").write_text(str(e))
            ROWS.append((name, f"did not start: {str(e)[:200]}", ""))
            return
        cpu = cpu_seconds(router.proc.pid)
        text = sh(name, nanoserve("bench", "serve", "--target", *target, "--vocab-size",
                                  vocab), timeout=420)
        cpu = cpu_seconds(router.proc.pid) - cpu
        m = re.search(r"Throughput: ([\d.]+) tok/s\s+TTFT p50/p99: ([\d./]+) ms\s+ITL "
                      r"p50/p99: ([\d./]+) ms", text)
        ROWS.append((f"{name} via router (256 streams at once)", _found(m, "tok/s"),
                     "vs offline"))
        if m:
            ROWS.append((f"{name} TTFT / inter-chunk p50/p99",
                         f"{m.group(2)} ms / {m.group(3)} ms", ""))
        t = re.search(r"Time: ([\d.]+)s.*client CPU ([\d.]+) s", text, re.S)
        if t:
            ROWS.append((f"{name}: CPU of router / client, share of a core",
                         f"{cpu / float(t.group(1)):.0%} / "
                         f"{float(t.group(2)) / float(t.group(1)):.0%}", ""))
    finally:
        for proc in reversed(procs):
            proc.stop(timeout=60)
            (OUT / f"{name}_{proc.name}.log").write_text(proc.output())


def stage_profile(args) -> None:
    """Host profile and kernel table of decode steps at batch 256 and 1 (logs only)."""
    for batch, steps in ((256, 64), (1, 256)):
        text = sh(f"profile_b{batch}", [sys.executable, "-m", "benchmarks.profile_decode",
                                        "--model", args.model, "--batch", str(batch),
                                        "--steps", str(steps)], timeout=300)
        ROWS.append((f"profile: batch {batch} decode step",
                     _found(re.search(r"= ([\d.]+) ms/step", text), "ms"),
                     f"profile_b{batch}.log"))


def stage_tp(args) -> None:
    """Each of --tp-models at each of --tp-sizes the GPUs allow: single request (512 + 512),
    and with --tp-throughput the nano-vllm bench workload."""
    import torch

    for model in args.tp_models.split(","):
        for tp in map(int, args.tp_sizes.split(",")):
            if tp > torch.cuda.device_count():
                continue
            extra = ("--model", model, "--tensor-parallel-size", str(tp), "--max-model-len",
                     "4096")
            _offline(f"{model}_tp{tp}_single", f"{model} TP={tp} single decode", *extra,
                     *SINGLE, "--repeats", "2", timeout=420)
            if args.tp_throughput:
                _offline(f"{model}_tp{tp}_offline", f"{model} TP={tp} nano-vllm bench", *extra)


def stage_families(args) -> None:
    """Llama-3.2-1B and Qwen3-30B-A3B shapes: single request and the workload; the MoE
    workload once more under the profiler, for the fused MoE kernels' share of device time."""
    for model in ("llama-3.2-1b", "qwen3-30b-a3b"):
        extra = ("--model", model, "--max-model-len", "4096")
        _offline(f"{model}_single", f"{model} single decode", *extra, *SINGLE, "--repeats",
                 "3", timeout=420)
        _offline(f"{model}_offline", f"{model} offline", *extra)
    text = sh("moe_profile", nanoserve("bench", "offline", "--model", "qwen3-30b-a3b",
                                       "--max-model-len", "4096", "--profile"), timeout=540)
    ROWS.append(("qwen3-30b-a3b: fused MoE share of kernel time",
                 _found(re.search(r"fused MoE\s+[\d.]+ s\s+([\d.]+)%", text), "%"),
                 "moe_profile.log"))


def stage_spec(args) -> None:
    """Speculative decoding on the Qwen3-8B shape, one request (512 + 512): off, ngram K=4,
    ngram that never matches, a Qwen3-0.6B-shape draft; then the workload with and
    without ngram."""
    # Greedy: a random model's greedy output falls into loops, which prompt lookup predicts.
    single = ("--model", "qwen3-8b", "--max-model-len", "4096", *SINGLE, "--temperature", "0",
              "--repeats", "3")
    ngram = ("--speculative-method", "ngram", "--num-speculative-tokens", "4")
    runs = (("off", ()),
            ("ngram K=4", (*ngram, "--prompt-lookup-min", "2", "--prompt-lookup-max", "5")),
            ("ngram never matching", (*ngram, "--prompt-lookup-min", "4096",
                                      "--prompt-lookup-max", "4096")),
            ("draft qwen3-0.6b K=4", ("--speculative-method", "draft",
                                      "--num-speculative-tokens", "4",
                                      "--speculative-model", "qwen3-0.6b")))
    decode_ms = None  # a decode step's device time, from the run without speculation

    def note(text: str) -> str:
        acc = re.findall(r"acceptance ([\d.]+%), mean acceptance length ([\d.]+)", text)
        verify = re.findall(r"device per step: verify ([\d.]+) ms", text)
        out = f"acceptance {acc[-1][0]}, mean length {acc[-1][1]}" if acc else ""
        if verify and decode_ms:
            out += (f"; verify step {verify[-1]} ms = {float(verify[-1]) / decode_ms:.2f}x "
                    f"a decode step without speculation")
        return out

    for name, extra in runs:
        text, _ = _offline(f"spec_{name.split()[0]}_{len(extra)}",
                           f"Qwen3-8B single, speculation {name}", *single, *extra,
                           timeout=420, note=note)
        if not extra:  # speculation off: every step but the prefill is a plain decode step
            device = re.findall(r"device ([\d.]+) ms \(\d+ steps\)", text)
            decode_ms = float(device[-1]) if device else None
    for name, extra in (("off", ()), ("ngram K=4", (*ngram, "--prompt-lookup-min", "2",
                                                      "--prompt-lookup-max", "5"))):
        _offline(f"spec_offline_{len(extra)}", f"offline nano-vllm bench, speculation {name}",
                 "--model", args.model, *extra, note=_acceptance)


def stage_spec_batch(args) -> None:
    """Where speculation stops paying: the Qwen3-8B shape, B greedy requests (256 + 256) at
    once, ngram K=4 (never switched off) against speculation off."""
    for bs in (8, 32, 128):
        rates = []
        for extra in ((), ("--speculative-method", "ngram", "--num-speculative-tokens", "4",
                           "--prompt-lookup-min", "2", "--prompt-lookup-max", "5",
                           "--speculative-disable-by-batch-size", "1024")):
            _, rate = _offline(
                f"spec_batch_{bs}_{len(extra)}",
                f"Qwen3-8B {bs} requests, speculation {'ngram K=4' if extra else 'off'}",
                "--model", "qwen3-8b", "--max-model-len", "4096", "--num-seqs", str(bs),
                "--temperature", "0", "--min-input-len", "256", "--max-input-len", "256",
                "--min-output-len", "256", "--max-output-len", "256", "--no-record", *extra,
                timeout=300, note=_acceptance)
            rates.append(rate or 0.0)
        if rates[0]:
            ROWS.append((f"Qwen3-8B {bs} requests, ngram / off", f"{rates[1] / rates[0]:.2f}x", ""))


_DIFFUSION_RUN = re.compile(r"^batch (\d+) (\w+): ([\d.]+) tok/s \(.*?\), ([\d.]+) forward "
                            r"passes/token(?:, agreement with none ([\d.]+))?$", re.M)


def stage_diffusion(args) -> None:
    """LLaDA-8B shape (dummy bf16 weights), 64-token prompts, gen_length 256, steps 256,
    block_length 32, at batch 1 and 32 (a run each, with its own timeout): tokens/s of the
    plain reference loop (LLaDA's generate.py: the dense canvas recomputed every pass) and of
    the engine with caches off, the prefix cache, the dual cache, threshold 0.9 and head
    sparsity 0.5 on the dual cache; forward passes per generated token, and token agreement
    with caches off. Random weights make the confidences unlike a trained model's (near
    uniform): a 0.9 threshold hardly ever fires and agreement says little, so passes per
    token and agreement do not carry over to a trained LLaDA; tokens/s at a given number of
    passes do. Target: the dual cache at batch 32 at least 3x the plain loop at batch 32."""
    rates: dict[tuple[int, str], float] = {}
    for batch in map(int, args.diffusion_batch_sizes.split(",")):
        timeout = 300 if batch == 1 else 540
        name = f"diffusion_b{batch}"
        text = sh(name, nanoserve("bench", "diffusion", "--model", "llada-8b",
                                  "--batch-sizes", str(batch)), timeout=timeout)
        found = _DIFFUSION_RUN.findall(text)
        if not found:
            ROWS.append((f"LLaDA-8B diffusion batch {batch}", f"FAILED (see {name}.log)", ""))
        for b, variant, tps, per_token, agree in found:
            rates[int(b), variant] = float(tps)
            note = f"{per_token} passes/token" + (f", agreement {agree}" if agree else "")
            ROWS.append((f"LLaDA-8B diffusion batch {b}, {variant}", f"{tps} tok/s",
                         f"{note} (random weights)"))
    if rates.get((32, "plain")) and (32, "dual") in rates:
        ROWS.append(("LLaDA-8B diffusion batch 32, dual / plain",
                     f"{rates[32, 'dual'] / rates[32, 'plain']:.2f}x", "target >= 3x"))


# The routing benchmark's multi-tenant workload, scaled up: long tenant system prompts whose
# KV (64 tenants x 4096 tokens) is above one engine's cache (FLEET_KV_BLOCKS x 16 tokens).
FLEET_KV_BLOCKS = 12288
FLEET_WORKLOAD = ("--conversations-per-tenant", "8", "--turns", "4", "--system-prompt-len",
                  "4096", "--user-message-len", "256", "--max-tokens", "32", "--think-time",
                  "0.5", "--max-model-len", "8192")
FLEET_TENANTS_PER_ENGINE = 16
FLEET_RATE_PER_ENGINE = 16.0  # conversations started per second


def stage_fleet(args) -> None:
    """One engine per GPU (Qwen3-0.6B shape, dummy weights) behind one router, on the
    routing benchmark's multi-tenant workload: N engines under prefix, least-load and
    round-robin, and one engine with 1/N of the tenants and rate (the same load per engine).
    Target: N engines under prefix >= 0.9 x N x one engine's output tok/s, and TTFT p99 below
    round-robin's."""
    import torch

    from benchmarks.routing import parse_table

    n = torch.cuda.device_count()
    runs = {1: "prefix", n: "prefix,least-load,round-robin"}
    tables: dict[int, dict[str, dict[str, str]]] = {}
    for engines, policies in runs.items():
        text = sh(f"fleet_{engines}", nanoserve(
            "bench", "routing", "--model", args.model_dir, "--device", "cuda",
            "--engine-arg=--load-format=dummy", "--num-engines", str(engines),
            "--engine-devices", ",".join(map(str, range(engines))), "--policies", policies,
            "--num-kv-blocks", str(FLEET_KV_BLOCKS), "--tenants",
            str(FLEET_TENANTS_PER_ENGINE * engines), "--rate",
            str(FLEET_RATE_PER_ENGINE * engines), *FLEET_WORKLOAD), timeout=540)
        tables[engines] = {row["policy"]: row for row in parse_table(text)}
        for policy, row in tables[engines].items():
            ROWS.append((f"fleet: {engines} engine(s), {policy}",
                         f"{row.get('output tok/s', '?')} tok/s",
                         f"hit rate {row.get('prefix-cache hit rate', '?')}, TTFT p50/p99 "
                         f"{row.get('TTFT p50 (ms)', '?')}/{row.get('TTFT p99 (ms)', '?')} ms, "
                         f"per engine {row.get('requests per engine', '?')}"))
    one, fleet = tables.get(1, {}).get("prefix"), tables.get(n, {})
    if one and "prefix" in fleet:
        ratio = float(fleet["prefix"]["output tok/s"]) / (n * float(one["output tok/s"]))
        ROWS.append((f"fleet: {n} engines prefix / ({n} x one engine)", f"{ratio:.2f}",
                     "target >= 0.9"))


STAGES = {"tests": stage_tests, "offline": stage_offline, "single": stage_single,
          "serve": stage_serve, "profile": stage_profile, "tp": stage_tp,
          "families": stage_families, "spec": stage_spec, "spec_batch": stage_spec_batch,
          "diffusion": stage_diffusion, "fleet": stage_fleet}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="tests,offline,single,serve")
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--pytest-args", nargs="*", default=[])
    p.add_argument("--tp-throughput", action="store_true")
    p.add_argument("--tp-sizes", default="1,2,4")
    p.add_argument("--tp-models", default="qwen3-8b")
    p.add_argument("--diffusion-batch-sizes", default="1,32")
    args = p.parse_args()
    from benchmarks.model_configs import resolve_model

    args.model_dir, _ = resolve_model(args.model)
    sh("env", ["nvidia-smi"], timeout=30)
    for stage in args.stages.split(","):
        STAGES[stage](args)
    print("\n| check | result | note |\n|---|---|---|")
    for row in ROWS:
        print(f"| {' | '.join(row)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
