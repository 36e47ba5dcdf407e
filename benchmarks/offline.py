"""`nanoserve bench offline`: the nano-vllm bench workload through the offline LLM."""

from __future__ import annotations

import argparse
import time

from benchmarks.model_configs import PRESETS, resolve_model
from benchmarks.results import record
from benchmarks.workload import add_workload_arguments, workload_from_args
from engine_service.cli import add_engine_config_arguments, engine_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_config_arguments(parser)
    add_workload_arguments(parser)
    parser.add_argument("--no-record", action="store_true", help="do not write RESULTS.md")
    parser.add_argument("--single", action="store_true",
                        help="one request instead of the workload: prompt --max-input-len, "
                        "--max-output-len new tokens; reports decode tok/s")
    parser.epilog = f"--model also takes a preset with dummy weights: {', '.join(PRESETS)}"


def main(args: argparse.Namespace) -> int:
    from engine_service import LLM, SamplingParams
    from engine_service.engine import StepStats

    args.model, is_preset = resolve_model(args.model)
    if is_preset:
        args.load_format = "dummy"
    config = engine_config_from_args(args)
    kwargs = {k: v for k, v in vars(config).items() if k not in ("model", "hf_config")}
    llm = LLM(config.model, **kwargs)
    if args.single:
        return _single(llm, args)
    reqs = workload_from_args(args, llm.engine.vocab_size)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True,
                             max_tokens=r.max_tokens, seed=i) for i, r in enumerate(reqs)]
    prompts = [r.prompt_token_ids for r in reqs]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False)  # warm-up
    llm.engine.total_stats = stats = StepStats(num_steps=0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    total = sum(r.max_tokens for r in reqs)
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == total, f"expected {total} tokens (ignore_eos), got {produced}"
    tps = total / elapsed
    print(f"Total: {total} tok, Time: {elapsed:.2f}s, Throughput: {tps:.2f} tok/s")
    busy = stats.seconds - stats.wait_seconds
    print(f"{stats.num_steps} steps; host busy {busy:.2f} s ({busy / stats.num_steps * 1e3:.2f} "
          f"ms/step), waiting on the device {stats.wait_seconds:.2f} s, device busy "
          f"{stats.device_seconds:.2f} s ({stats.device_seconds / stats.num_steps * 1e3:.2f} "
          f"ms/step)")
    if not args.no_record:
        record("offline throughput (nano-vllm bench workload)", {
            "requests": str(len(reqs)),
            "output tokens": str(total),
            "wall time": f"{elapsed:.2f} s",
            "throughput": f"{tps:.1f} output tok/s",
        })
    return 0


def _single(llm, args: argparse.Namespace) -> int:
    """Decode speed of one request: from its first token to its last, timed on the engine's
    own steps after a full warm-up run of the same request (so no compile is timed)."""
    import random

    from engine_service import SamplingParams

    rng = random.Random(args.workload_seed)
    prompt = [rng.randrange(min(10000, llm.engine.vocab_size)) for _ in range(args.max_input_len)]
    n = args.max_output_len
    params = SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True, seed=0)
    engine = llm.engine
    for run in range(2):  # the first run warms up every kernel and graph this request uses
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
    ttft, decode = first - t0, end - first
    decode_tps = (n - 1) / max(decode, 1e-9)
    print(f"single request: prompt {len(prompt)}, {n} new tokens, first token {ttft * 1e3:.1f} "
          f"ms, then {decode * 1e3:.1f} ms for {n - 1} tokens: decode {decode_tps:.1f} tok/s "
          f"({decode / (n - 1) * 1e3:.3f} ms/token)")
    if not args.no_record:
        record("single-request decode", {
            "prompt tokens": str(len(prompt)), "new tokens": str(n),
            "first token": f"{ttft * 1e3:.1f} ms",
            "decode": f"{decode_tps:.1f} tok/s (first to last token, after a warm-up run)"})
    return 0
