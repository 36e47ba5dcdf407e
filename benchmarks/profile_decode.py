"""Where a decode step's time goes: host-side cProfile of decode steps at one batch size,
then the device's kernels over a few of those steps (torch.profiler, by total device time).
`python -m benchmarks.profile_decode [--model qwen3-0.6b] [--batch 256] [--steps 256]
[--tensor-parallel-size N]` (with N > 1 the kernel table is rank 0's)."""

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
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--kernel-steps", type=int, default=8,
                   help="decode steps under torch.profiler (0: skip)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    args = p.parse_args()
    from benchmarks.model_configs import resolve_model
    from engine_service import LLM, SamplingParams

    model_dir, preset = resolve_model(args.model)
    llm = LLM(model_dir, load_format="dummy" if preset else "auto", max_model_len=2048,
              tensor_parallel_size=args.tensor_parallel_size)
    prompts = [[(7 * i + j) % 10000 for j in range(args.prompt_len)]
               for i in range(args.batch)]
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
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if args.kernel_steps:
        _kernel_table(llm, prompts, args.kernel_steps)
    llm.engine.shutdown()


def _kernel_table(llm, prompts: list[list[int]], steps: int) -> None:
    """Device time per kernel over `steps` decode steps (after the prefill step)."""
    from torch.profiler import ProfilerActivity, profile

    from engine_service import SamplingParams

    sp = SamplingParams(temperature=0.6, max_tokens=steps + 1, ignore_eos=True, seed=0)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"prof-{i}", prompt, sp)
    engine.step()  # the prefill
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                    max_name_column_width=70))


if __name__ == "__main__":
    main()
