"""Every GPU figure in one call: `python -m benchmarks.gpu_suite [--stages ...]`.

Stages: tests (tests/gpu), offline (nano-vllm bench workload, Qwen3-0.6B shape, dummy
bf16 weights), offline_sync (the same without async scheduling), profile (host and kernel
profile of batch-256 and batch-1 decode steps), allreduce (fast vs NCCL all-reduce), single (one
request, 512-token prompt, 512 new tokens), serve (the same
workload as concurrent streams against one engine process), hbm (copy bandwidth and the
decode step's achieved bandwidth), tp (Qwen3-8B shape at TP=1/2/4 where GPUs allow; with
--tp-throughput also the workload), tp_push (TP=2/4 single request with the row-parallel
GEMVs' push off and on), profile_tp (Qwen3-8B batch-1 profiles at TP=1/2/4),
offline_profile (the workload under torch.profiler, device time by kernel group),
kernels (attention split-count and GEMV config sweeps), decode_graph (device time of the
captured decode graph with programmatic dependent launch off and on), ab (Qwen3-8B single
request on several source trees in turn: `--ab-trees main=. exp=/tmp/X,VAR=VALUE`).
Logs go to $OUT (or ./.out); figures are appended to RESULTS.md (NANOSERVE_RESULTS to
redirect); a table is printed last.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("OUT", ROOT / ".out"))
ROWS: list[tuple[str, str, str]] = []


def sh(name: str, cmd: list[str], timeout: float, env: dict | None = None,
       cwd: Path = ROOT) -> str:
    """Run a command, tee its output to OUT/name.log, return the output."""
    OUT.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        text = proc.stdout + proc.stderr
        rc = proc.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    (OUT / f"{name}.log").write_text(text)
    print(f"[{name}] rc={rc} in {time.perf_counter() - t0:.0f}s", flush=True)
    if rc != 0:
        print(text[-3000:], flush=True)
    return text


def nanoserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "clients.cli", *args]


# Run alone after the rest: their engines size the KV cache from the memory the GPUs have
# free, which pytest-xdist workers running beside them (engine tests among them) can take
# between the test's measurement and the ranks' profiling.
ALONE_GPU_TESTS = "tests/gpu/test_tp_gpu.py"


def stage_tests(args) -> None:
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    texts = []
    for name, cmd in (("gpu_tests", [*pytest, "tests/gpu", f"--ignore={ALONE_GPU_TESTS}",
                                     *args.pytest_args]),
                      ("gpu_tests_alone", [*pytest, ALONE_GPU_TESTS])):
        text = sh(name, cmd, timeout=540)
        texts.append(text)
        m = re.search(r"((\d+ failed, )?\d+ passed[^\n]*)", text)
        ROWS.append((name.replace("gpu_tests", "tests/gpu").replace("_", " "),
                     m.group(1) if m else f"FAILED (see {name}.log)", "pytest"))
    agree = re.search(r"argmax agreement: ([\d.]+)", "\n".join(texts))
    if agree:
        ROWS.append(("bf16 teacher-forced argmax agreement", agree.group(1), ">= 0.98"))


def stage_offline(args, name: str = "offline", extra: tuple[str, ...] = ()) -> None:
    text = sh(name, nanoserve("bench", "offline", "--model", args.model, *extra,
                              *args.engine_args), timeout=540)
    m = re.search(r"Throughput: ([\d.]+) tok/s", text)
    label = "offline nano-vllm bench" + (f" ({' '.join(extra)})" if extra else "")
    ROWS.append((label, f"{m.group(1)} tok/s" if m else "FAILED",
                 ">= 24,000 (nano-vllm 20,400)"))
    m = re.search(r"(\d+) steps; host busy ([\d.]+) s \(([\d.]+) ms/step\), waiting on the "
                  r"device ([\d.]+) s, device busy ([\d.]+) s", text)
    if m:
        ROWS.append(("  host busy / waiting on device / device busy",
                     f"{m.group(2)} s ({m.group(3)} ms/step) / {m.group(4)} s / {m.group(5)} s",
                     f"{m.group(1)} steps"))


def stage_offline_profile(args) -> None:
    """The workload under torch.profiler: device time by kernel group (log only)."""
    text = sh("offline_profile", nanoserve("bench", "offline", "--model", args.model,
                                           "--profile", *args.engine_args), timeout=540)
    m = re.search(r"device time by kernel group \(whole run, ([\d.]+) s", text)
    ROWS.append(("offline under the profiler: kernel time", f"{m.group(1)} s" if m else
                 "FAILED", "offline_profile.log"))


def stage_offline_sync(args) -> None:
    """The same workload without async scheduling: what overlapping host work buys."""
    stage_offline(args, "offline_sync", ("--no-async-scheduling", "--no-record"))


def stage_profile(args) -> None:
    """Host profile and kernel table of decode steps at batch 256 and 1 (logs only)."""
    for batch, steps in ((256, 64), (1, 256)):
        text = sh(f"profile_b{batch}", [sys.executable, "-m", "benchmarks.profile_decode",
                                        "--model", args.model, "--batch", str(batch),
                                        "--steps", str(steps)], timeout=300)
        m = re.search(r"= ([\d.]+) ms/step", text)
        ROWS.append((f"profile: batch {batch} decode step", f"{m.group(1)} ms" if m else
                     "FAILED", f"profile_b{batch}.log"))


def stage_profile_tp(args) -> None:
    """Qwen3-8B batch-1 decode profiles at TP=1, 2 and 4 (rank 0's kernels; logs only)."""
    import torch

    for tp in (1, 2, 4):
        if tp > torch.cuda.device_count():
            continue
        text = sh(f"profile_8b_tp{tp}", [sys.executable, "-m", "benchmarks.profile_decode",
                                         "--model", "qwen3-8b", "--batch", "1", "--steps",
                                         "128", "--tensor-parallel-size", str(tp)], timeout=300)
        m = re.search(r"= ([\d.]+) ms/step", text)
        ROWS.append((f"profile: Qwen3-8B TP={tp} batch 1 step", f"{m.group(1)} ms" if m else
                     "FAILED", f"profile_8b_tp{tp}.log"))


def stage_kernels(args) -> None:
    """Kernel sweeps that tune launch choices: decode-attention split counts and the GEMV
    config table against cuBLAS (logs only; paste-able tables at their ends)."""
    sh("attention_splits", [sys.executable, "-m", "benchmarks.attention_bench",
                            "--sweep-splits", "--layouts", "qwen3-0.6b"], timeout=180)
    text = sh("gemv", [sys.executable, "-m", "benchmarks.gemv_bench", "--m", "1,4",
                       "--rep", "2"], timeout=300)
    ROWS.append(("GEMV vs cuBLAS sweep", "see gemv.log" if "TUNED" in text else "FAILED", ""))


def stage_allreduce(args) -> None:
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        return
    text = sh("allreduce", [sys.executable, "-m", "benchmarks.allreduce_bench",
                            "--world-size", str(min(n, 4))], timeout=180)
    ROWS.append(("all-reduce microbench", "see allreduce.log" if "|" in text else "FAILED",
                 ""))


def _decode_rate(text: str) -> re.Match | None:
    """The median line of a --repeats run, else the one run's."""
    return (re.search(r"median of \d+ runs: decode ([\d.]+) tok/s", text)
            or re.search(r"decode ([\d.]+) tok/s", text))


def stage_single(args) -> None:
    # Host-bound at ~0.9 ms a step, so runs spread by several percent: the median of three.
    text = sh("single", nanoserve("bench", "offline", "--model", args.model, "--single",
                                  "--max-input-len", "512", "--max-output-len", "512",
                                  "--repeats", "3", *args.engine_args), timeout=300)
    m = _decode_rate(text)
    ROWS.append(("single request decode (512+512)", f"{m.group(1)} tok/s" if m else "FAILED",
                 ">= 1,000 (nano-vllm ~475)"))


def stage_serve(args) -> None:
    from benchmarks.procs import ServerProc

    OUT.mkdir(parents=True, exist_ok=True)
    engine = ServerProc("engine", ["engine", "--model", args.model_dir, "--port", "0",
                                   "--load-format", "dummy", *args.engine_args])
    try:
        try:
            engine.wait_for("nanoserve engine ready", timeout=240)
        except RuntimeError as e:
            ROWS.append(("serve", "engine did not start (serve_engine.log)", ""))
            (OUT / "serve_engine.log").write_text(str(e))
            return
        text = sh("serve", nanoserve("bench", "serve", "--target", engine.target), timeout=420)
        m = re.search(r"Throughput: ([\d.]+) tok/s\s+TTFT p50/p99: ([\d./]+) ms\s+ITL p50/p99: "
                      r"([\d./]+) ms", text)
        if m:
            ROWS.append(("serve (256 streams at once)", f"{m.group(1)} tok/s", ">= 90% offline"))
            ROWS.append(("serve TTFT p50/p99", f"{m.group(2)} ms", ""))
            ROWS.append(("serve inter-token p50/p99", f"{m.group(3)} ms", ""))
        else:
            ROWS.append(("serve", "FAILED (serve.log)", ""))
    finally:
        engine.stop(timeout=60)
        (OUT / "serve_engine.log").write_text(engine.output())


def stage_hbm(args) -> None:
    text = sh("hbm", [sys.executable, "-m", "benchmarks.hbm", "--model", args.model_dir],
              timeout=300)
    for line in text.splitlines():
        if line.startswith("ROW "):
            name, value, note = line[4:].split(" | ")
            ROWS.append((name, value, note))


def _tp_single(tp: int, *more: str) -> list[str]:
    """The Qwen3-8B single-request decode bench (512 + 512 tokens, median of 2) at TP=tp."""
    return nanoserve("bench", "offline", "--model", "qwen3-8b", "--single", "--max-input-len",
                     "512", "--max-output-len", "512", "--repeats", "2", "--tensor-parallel-size",
                     str(tp), "--max-model-len", "4096", *more)


def stage_tp(args) -> None:
    import torch

    n = torch.cuda.device_count()
    for tp in (1, 2, 4):
        if tp > n:
            continue
        extra = ["--tensor-parallel-size", str(tp), "--max-model-len", "4096"]
        text = sh(f"tp{tp}_single", _tp_single(tp), timeout=420)
        m = _decode_rate(text)
        ROWS.append((f"Qwen3-8B TP={tp} single decode", f"{m.group(1)} tok/s" if m else "FAILED",
                     ""))
        if args.tp_throughput:
            text = sh(f"tp{tp}_offline", nanoserve("bench", "offline", "--model", "qwen3-8b",
                                                   *extra), timeout=540)
            m = re.search(r"Throughput: ([\d.]+) tok/s", text)
            ROWS.append((f"Qwen3-8B TP={tp} nano-vllm bench",
                         f"{m.group(1)} tok/s" if m else "FAILED", ""))


def stage_tp_push(args) -> None:
    """TP=2 and TP=4 single request with the row-parallel GEMVs' push into the all-reduce
    buffers off, then on (NANOSERVE_PUSH_PARTIALS forces either way), in one call: the
    push's A/B per size (by default it pushes at TP=2 only: PUSH_PARTIALS_MAX_RANKS)."""
    import torch

    n = torch.cuda.device_count()
    for tp in (2, 4):
        if tp > n:
            continue
        for push in ("0", "1"):
            text = sh(f"tp{tp}_push{push}_single", _tp_single(tp, "--no-record"),
                      timeout=420, env={"NANOSERVE_PUSH_PARTIALS": push})
            _add_single_row(f"Qwen3-8B TP={tp} single decode, push={push}", text)


def _add_single_row(label: str, text: str) -> None:
    """A table row from a single-request bench's output: its median rate and each run's
    device time a step."""
    m = _decode_rate(text)
    device = re.findall(r"device ([\d.]+) ms", text)
    ROWS.append((label, f"{m.group(1)} tok/s" if m else "FAILED",
                 f"device ms/step {' / '.join(device)}"))


def parse_ab_tree(spec: str) -> tuple[str, Path, dict[str, str]]:
    """"NAME=DIR[,VAR=VALUE...]" -> (name, directory, environment). Commas separate the
    settings, so a VALUE cannot hold one."""
    name, _, rest = spec.partition("=")
    directory, *settings = rest.split(",")
    if not name or not directory:
        raise ValueError(f"--ab-trees entry must be NAME=DIR[,VAR=VALUE...], got {spec!r}")
    env = {}
    for setting in settings:
        var, eq, value = setting.partition("=")
        if not var or not eq:
            raise ValueError(f"--ab-trees setting must be VAR=VALUE, got {setting!r} in {spec!r}")
        env[var] = value
    return name, Path(directory).resolve(), env


def _tree_env(directory: Path, env: dict[str, str]) -> dict[str, str]:
    """`env` plus a PYTHONPATH that starts with the tree (an empty entry would mean the
    working directory, so none is added when PYTHONPATH is unset)."""
    entries = [str(directory), str(directory / "proto"), os.environ.get("PYTHONPATH", "")]
    return {**env, "PYTHONPATH": os.pathsep.join(e for e in entries if e)}


def stage_ab(args) -> None:
    """Qwen3-8B single request on each --ab-trees tree in turn, --ab-rounds times, at each
    --ab-tp size. Each run starts inside its tree: `python -m` puts the working directory
    ahead of PYTHONPATH, so a run started elsewhere would import that directory's code (it
    voided session 19's A/Bs); each tree's import is checked before its runs."""
    trees = [parse_ab_tree(spec) for spec in args.ab_trees]
    for name, directory, env in trees:
        text = sh(f"ab_{name}_import", [sys.executable, "-c",
                                        "import models.parallel as m; print(m.__file__)"],
                  timeout=60, env=_tree_env(directory, env), cwd=directory)
        lines = text.strip().splitlines()
        if not lines or not Path(lines[-1]).resolve().is_relative_to(directory):
            raise RuntimeError(f"tree {name} imports {lines[-1:]}, not from {directory}")
    for tp in args.ab_tp:
        for round_ in range(1, args.ab_rounds + 1):
            for name, directory, env in trees:
                text = sh(f"ab_tp{tp}_{name}_{round_}", _tp_single(tp, "--no-record"),
                          timeout=420, env=_tree_env(directory, env), cwd=directory)
                _add_single_row(f"A/B TP={tp} {name}, round {round_}", text)


def stage_decode_graph(args) -> None:
    """Device time of the captured decode graph with programmatic dependent launch off and
    on (one process per setting: graphs are captured at start-up)."""
    for model, batches in ((args.model, "1,8"), ("qwen3-8b", "1")):
        for pdl in ("0", "1"):
            text = sh(f"decode_graph_{model}_pdl{pdl}",
                      [sys.executable, "-m", "benchmarks.decode_graph", "--model", model,
                       "--batch", batches], timeout=240, env={"NANOSERVE_PDL": pdl})
            for m in re.finditer(r"batch (\d+), context \d+, .*?: [\d.]+ us a replay .*?, "
                                 r"([\d.]+) us a replay over", text):
                ROWS.append((f"decode graph {model} batch {m.group(1)}, PDL={pdl}",
                             f"{m.group(2)} us", "layers + final norm, context 768"))


STAGES = {"tests": stage_tests, "offline": stage_offline, "offline_sync": stage_offline_sync,
          "offline_profile": stage_offline_profile,
          "single": stage_single, "serve": stage_serve, "hbm": stage_hbm, "tp": stage_tp,
          "tp_push": stage_tp_push,
          "profile": stage_profile, "profile_tp": stage_profile_tp,
          "allreduce": stage_allreduce, "kernels": stage_kernels,
          "decode_graph": stage_decode_graph, "ab": stage_ab}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="tests,offline,single,serve,hbm")
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--engine-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--pytest-args", nargs="*", default=[])
    p.add_argument("--tp-throughput", action="store_true")
    p.add_argument("--ab-trees", nargs="*", default=[],
                   help="stage ab: NAME=DIR[,VAR=VALUE...] per tree, e.g. main=. "
                        "local=/tmp/L,NANOSERVE_PUSH_PARTIALS=local")
    p.add_argument("--ab-tp", nargs="*", type=int, default=[4])
    p.add_argument("--ab-rounds", type=int, default=2)
    args = p.parse_args()
    from benchmarks.model_configs import resolve_model

    args.model_dir, _ = resolve_model(args.model)
    sh("env", ["nvidia-smi"], timeout=30)
    for stage in args.stages.split(","):
        STAGES[stage](args)
    print("\n| check | result | target |\n|---|---|---|")
    for row in ROWS:
        print(f"| {' | '.join(row)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
