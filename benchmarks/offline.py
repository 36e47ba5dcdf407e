"""`nanoserve bench offline`: the nano-vllm bench workload through the offline LLM."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import pkgutil
import time

from benchmarks.model_configs import PRESETS, resolve_model
from benchmarks.results import record
from benchmarks.workload import add_workload_arguments, workload_from_args
from engine_service.cli import add_engine_config_arguments, engine_config_from_args

# A record whose array needs more items than 1024 tokens can hold: the grammar never ends
# early, so the run produces the same tokens as an unconstrained one.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 64},
                   "scores": {"type": "array", "items": {"type": "number"}, "minItems": 2048}},
    "required": ["id", "name", "scores"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_config_arguments(parser)
    add_workload_arguments(parser)
    parser.add_argument("--no-record", action="store_true", help="do not log the figures")
    parser.add_argument("--single", action="store_true",
                        help="one request instead of the workload: prompt --max-input-len, "
                        "--max-output-len new tokens; reports decode tok/s")
    parser.add_argument("--repeats", type=int, default=1,
                        help="with --single: timed runs after the warm-up (median recorded)")
    parser.add_argument("--profile", action="store_true",
                        help="run the workload under torch.profiler and print device time "
                        "per kernel group and per kernel (slower; nothing is recorded)")
    parser.add_argument("--json-schema", action="store_true",
                        help="constrain every request to BENCH_SCHEMA (structured output); "
                        "it cannot complete within 1024 tokens, so lengths stay the same")
    parser.epilog = f"--model also takes a preset with dummy weights: {', '.join(PRESETS)}"


def main(args: argparse.Namespace) -> int:
    from engine_service import LLM, SamplingParams
    from engine_service.engine import StepStats

    args.model, is_preset = resolve_model(args.model, tokenizer=args.json_schema)
    if args.speculative_model:  # a preset drafts with dummy weights too
        args.speculative_model, _ = resolve_model(args.speculative_model)
    if is_preset:
        args.load_format = "dummy"
    config = engine_config_from_args(args)
    kwargs = {k: v for k, v in vars(config).items() if k not in ("model", "hf_config")}
    llm = LLM(config.model, **kwargs)
    if args.single:
        return _single(llm, args)
    reqs = workload_from_args(args, llm.engine.vocab_size)
    schema = {"json_schema": json.dumps(BENCH_SCHEMA)} if args.json_schema else {}
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True,
                             max_tokens=r.max_tokens, seed=i, **schema)
              for i, r in enumerate(reqs)]
    prompts = [r.prompt_token_ids for r in reqs]
    # Warm-up; it also compiles the schema, which the compiler then holds.
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, **schema)] * 2, use_tqdm=False)
    if llm.engine.speculator is not None:
        llm.engine.speculator.take_stats()  # the warm-up's counts
    structured = llm.engine.structured
    structured.fill_seconds, structured.num_fills = 0.0, 0
    llm.engine.total_stats = stats = StepStats(num_steps=0)
    compiled = _triton_variants()
    profiler = _profiler() if args.profile else contextlib.nullcontext()
    with profiler:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
    if args.profile:
        args.no_record = True  # the profiler's overhead is in the wall time
        _print_kernel_groups(profiler)
    total = sum(r.max_tokens for r in reqs)
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == total, f"expected {total} tokens (ignore_eos), got {produced}"
    tps = total / elapsed
    print(f"Total: {total} tok, Time: {elapsed:.2f}s, Throughput: {tps:.2f} tok/s (output "
          f"tokens / wall time; the bar's prefill= and decode= are prompt and decode tokens "
          f"per wall-clock second)")
    busy = stats.seconds - stats.wait_seconds
    new = {k: n - compiled.get(k, 0) for k, n in _triton_variants().items()
           if n > compiled.get(k, 0)}
    # A compile mid-run stalls the host between two launches of a step: device time lost.
    print(f"Triton kernels compiled during the run: {new or 'none'}")
    print(f"{stats.num_steps} steps; host busy {busy:.2f} s ({busy / stats.num_steps * 1e3:.2f} "
          f"ms/step), waiting on the device {stats.wait_seconds:.2f} s, device busy "
          f"{stats.device_seconds:.2f} s ({stats.device_seconds / stats.num_steps * 1e3:.2f} "
          f"ms/step)")
    _print_speculation(llm.engine)
    if structured.num_fills:
        print(f"bitmask fill (host, overlapping the forward pass): "
              f"{structured.fill_seconds / structured.num_fills * 1e3:.2f} ms/step over "
              f"{structured.num_fills} steps")
    if not args.no_record:
        record("offline throughput (nano-vllm bench workload)", {
            "requests": str(len(reqs)),
            "output tokens": str(total),
            "wall time": f"{elapsed:.2f} s",
            "throughput": f"{tps:.1f} output tok/s",
        })
    return 0


# Kernel name fragments -> group, first match wins (Triton kernels keep their function
# names; cuBLAS GEMMs carry "gemm"/"gemv" or the CUTLASS "sm90_xmma" family names).
_KERNEL_GROUPS = (
    ("fused MoE", ("_gate_up_kernel", "_down_kernel", "_align_kernel", "_count_kernel",
                   "_sum_kernel", "_topk_kernel")),
    ("attention", ("_paged_attention", "flash")),
    ("kv store / rope", ("store_kv", "rope_store")),
    ("gemm / gemv", ("gemm", "gemv", "xmma", "cutlass", "sm90", "matmul")),
    ("sampling", ("_race_partial", "_combine_kernel", "sample", "argmax", "softmax")),
    ("all-reduce / nccl", ("nccl", "all_reduce", "allreduce", "symm")),
    ("norms, silu (inductor)", ("triton_poi", "triton_red", "triton_per")),
)


def _triton_variants() -> dict[str, int]:
    """Compiled variants per nanoserve Triton kernel (all devices); empty without triton."""
    if importlib.util.find_spec("triton") is None:
        return {}
    from triton.runtime.jit import JITFunction

    import models.kernels

    counts = {}
    for info in pkgutil.iter_modules(models.kernels.__path__):
        module = importlib.import_module(f"models.kernels.{info.name}")
        for attr, fn in vars(module).items():
            if isinstance(fn, JITFunction):
                caches = getattr(fn, "device_caches", {}).values()
                counts[attr] = sum(len(c[0]) for c in caches)
    return counts


def _profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA])


def _print_kernel_groups(profiler) -> None:
    """Device time of the whole run by kernel group, then the top kernels."""
    events = [e for e in profiler.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) or 1.0
    groups: dict[str, float] = {}
    for e in events:
        name = e.key.lower()
        group = next((g for g, keys in _KERNEL_GROUPS if any(k in name for k in keys)), "other")
        groups[group] = groups.get(group, 0.0) + e.device_time_total
    print(f"device time by kernel group (whole run, {total / 1e6:.3f} s of kernels):")
    for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"  {group:28s} {us / 1e6:8.3f} s  {100 * us / total:5.1f}%")
    print("top kernels (device s, calls, mean us):")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:30]:
        print(f"  {e.device_time_total / 1e6:8.3f} {e.count:8d} "
              f"{e.device_time_total / max(e.count, 1):9.1f}  {e.key[:110]}")
    _print_gaps(profiler)


def _print_gaps(profiler, min_gap_us: float = 3.0) -> None:
    """Where the device sat idle between kernels: gaps of at least `min_gap_us`, grouped by
    the kernel that ended before the gap and the one that started after it."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in profiler.events()
                   if e.device_type == DeviceType.CUDA)
    if not spans:
        return
    groups: dict[tuple[str, str], list[float]] = {}
    busy_until, before = spans[0][1], spans[0][2]
    idle = 0.0
    for start, end, name in spans[1:]:
        gap = start - busy_until
        if gap >= min_gap_us:
            idle += gap
            groups.setdefault((before[:40], name[:40]), []).append(gap)
        if end > busy_until:
            busy_until, before = end, name
    print(f"device idle in gaps >= {min_gap_us:g} us: {idle / 1e6:.3f} s of "
          f"{(busy_until - spans[0][0]) / 1e6:.3f} s (first kernel to last; under the "
          f"profiler, whose host overhead widens host-bound gaps)")
    print("largest gap groups (total s, count, median us, kernel before -> kernel after):")
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:15]
    for (prev, nxt), gaps in ranked:
        gaps.sort()
        print(f"  {sum(gaps) / 1e6:8.3f} {len(gaps):7d} {gaps[len(gaps) // 2]:9.1f}  "
              f"{prev} -> {nxt}")


def _print_speculation(engine) -> None:
    """Acceptance since the last call, and the device time of a verify step against a
    plain step's (CUDA events around each step)."""
    if engine.speculator is None:
        return
    spec, stats = engine.speculator.take_stats(), engine.total_stats
    rate = spec.num_accepted_tokens / max(spec.num_draft_tokens, 1)
    per_pos = " ".join(f"{n / max(spec.num_drafts, 1):.2f}" for n in spec.accepted_per_pos)
    print(f"speculation: {spec.num_drafts} drafts, {spec.num_draft_tokens} proposed, "
          f"{spec.num_accepted_tokens} accepted: acceptance {rate:.1%}, mean acceptance "
          f"length {1 + spec.num_accepted_tokens / max(spec.num_drafts, 1):.2f}, per "
          f"position {per_pos}")
    plain = stats.num_steps - stats.num_verify_steps
    if stats.device_seconds and stats.num_verify_steps and plain:
        verify_ms = stats.verify_device_seconds / stats.num_verify_steps * 1e3
        plain_ms = (stats.device_seconds - stats.verify_device_seconds) / plain * 1e3
        print(f"device per step: verify {verify_ms:.3f} ms ({stats.num_verify_steps} steps), "
              f"other {plain_ms:.3f} ms ({plain} steps): ratio {verify_ms / plain_ms:.2f}")


def _single(llm, args: argparse.Namespace) -> int:
    """Decode speed of one request: from its first token to its last, timed on the engine's
    own steps after a full warm-up run of the same request (so no compile is timed);
    --repeats timed runs, the median recorded. Each run's host and device time per step
    say which side set the pace."""
    import random
    import statistics

    from engine_service import SamplingParams
    from engine_service.engine import StepStats

    rng = random.Random(args.workload_seed)
    prompt = [rng.randrange(min(10000, llm.engine.vocab_size)) for _ in range(args.max_input_len)]
    n = args.max_output_len
    params = SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, seed=0)
    engine = llm.engine
    rates, ttfts = [], []
    for run in range(1 + args.repeats):  # run 0 warms up every kernel and graph it uses
        engine.total_stats = stats = StepStats(num_steps=0)
        engine.add_request(f"single-{run}", prompt, params)
        t0 = time.perf_counter()
        first = None
        produced = 0
        while engine.has_unfinished():
            for out in engine.step():
                produced += len(out.new_token_ids)
                if first is None and produced:
                    first = time.perf_counter()
        end = time.perf_counter()
        assert produced == n, f"expected {n} tokens, got {produced}"
        if run == 0:
            if engine.speculator is not None:
                engine.speculator.take_stats()  # the warm-up's counts
            continue
        ttft, decode = first - t0, end - first
        rates.append((n - 1) / max(decode, 1e-9))
        ttfts.append(ttft)
        steps = max(stats.num_steps, 1)
        print(f"single request: prompt {len(prompt)}, {n} new tokens, first token "
              f"{ttft * 1e3:.1f} ms, then {decode * 1e3:.1f} ms for {n - 1} tokens: decode "
              f"{rates[-1]:.1f} tok/s ({decode / (n - 1) * 1e3:.3f} ms/token); per step: host "
              f"busy {(stats.seconds - stats.wait_seconds) / steps * 1e3:.3f} ms, device "
              f"{stats.device_seconds / steps * 1e3:.3f} ms ({stats.num_steps} steps)")
        _print_speculation(engine)
    decode_tps = statistics.median(rates)
    if args.repeats > 1:
        print(f"median of {args.repeats} runs: decode {decode_tps:.1f} tok/s")
    if not args.no_record:
        record("single-request decode", {
            "prompt tokens": str(len(prompt)), "new tokens": str(n),
            "first token": f"{statistics.median(ttfts) * 1e3:.1f} ms",
            "decode": f"{decode_tps:.1f} tok/s (first to last token, after a warm-up run"
                      + (f"; median of {args.repeats} runs)" if args.repeats > 1 else ")")})
    return 0
