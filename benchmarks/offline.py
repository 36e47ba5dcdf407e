"""`nanoserve bench offline`: the nano-vllm bench workload through the offline LLM."""

from __future__ import annotations

import argparse
import time

from benchmarks.results import record
from benchmarks.workload import add_workload_arguments, workload_from_args
from engine_service.cli import add_engine_config_arguments, engine_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_config_arguments(parser)
    add_workload_arguments(parser)
    parser.add_argument("--no-record", action="store_true", help="do not write RESULTS.md")


def main(args: argparse.Namespace) -> int:
    from engine_service import LLM, SamplingParams

    config = engine_config_from_args(args)
    kwargs = {k: v for k, v in vars(config).items() if k not in ("model", "hf_config")}
    llm = LLM(config.model, **kwargs)
    reqs = workload_from_args(args, llm.engine.vocab_size)
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True,
                             max_tokens=r.max_tokens, seed=i) for i, r in enumerate(reqs)]
    prompts = [r.prompt_token_ids for r in reqs]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    total = sum(r.max_tokens for r in reqs)
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == total, f"expected {total} tokens (ignore_eos), got {produced}"
    tps = total / elapsed
    print(f"Total: {total} tok, Time: {elapsed:.2f}s, Throughput: {tps:.2f} tok/s")
    if not args.no_record:
        record("offline throughput (nano-vllm bench workload)", {
            "requests": str(len(reqs)),
            "output tokens": str(total),
            "wall time": f"{elapsed:.2f} s",
            "throughput": f"{tps:.1f} output tok/s",
        })
    return 0
