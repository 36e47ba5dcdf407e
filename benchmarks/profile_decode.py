"""Where a decode step's time goes: host-side cProfile of single-request decode steps, and
the CUDA-graph replay alone. `python -m benchmarks.profile_decode [--model qwen3-0.6b]`."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args()
    from benchmarks.model_configs import resolve_model
    from engine_service import LLM, SamplingParams

    model_dir, preset = resolve_model(args.model)
    llm = LLM(model_dir, load_format="dummy" if preset else "auto", max_model_len=2048)
    prompts = [[(7 * i + j) % 10000 for j in range(512)] for i in range(args.batch)]
    sp = SamplingParams(temperature=0.6, max_tokens=args.steps, ignore_eos=True, seed=0)
    llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(prompts, sp, use_tqdm=False)
    prof.disable()
    dt = time.perf_counter() - t0
    print(f"batch {args.batch}: {args.steps} steps in {dt:.3f}s = {dt / args.steps * 1e3:.3f} "
          f"ms/step ({args.batch * args.steps / dt:.0f} tok/s)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
