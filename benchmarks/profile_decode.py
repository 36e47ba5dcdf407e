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
    _critical_path(prof, steps)


def _critical_path(prof, steps: int) -> None:
    """What each kernel adds to the step: with programmatic dependent launch a kernel starts
    before the previous one ends, so its own duration overstates its cost. Walking the
    kernels in start order, a kernel's share is how far it moves the latest end seen so far;
    time with no kernel running is "idle". Also one mid-step layer's kernels in order."""
    from torch.autograd import DeviceType

    kernels = sorted((e.start_ns(), e.start_ns() + e.duration_ns(), e.name())
                     for e in prof.profiler.kineto_results.events()
                     if e.device_type() == DeviceType.CUDA)
    if not kernels:
        return
    share: dict[str, float] = {}
    count: dict[str, int] = {}
    rows = []
    latest = kernels[0][0]
    for start, end, name in kernels:
        name = name[:60]
        idle = max(0, start - latest)
        share["idle"] = share.get("idle", 0.0) + idle
        added = max(0, end - max(latest, start))
        share[name] = share.get(name, 0.0) + added
        count[name] = count.get(name, 0) + 1
        rows.append((start, end, name, idle + added))
        latest = max(latest, end)
    total = sum(share.values())
    print(f"\ncritical path per step ({steps} steps, {total / steps / 1e3:.1f} us a step):")
    print(f"{'kernel':62s} {'calls':>6s} {'us/step':>9s} {'share':>7s}")
    for name, ns in sorted(share.items(), key=lambda kv: -kv[1]):
        print(f"{name:62s} {count.get(name, 0) / steps:6.1f} {ns / steps / 1e3:9.1f} "
              f"{ns / total:7.1%}")
    # From the middle of the run, at the first launch of the most frequent kernel (a layer's,
    # not the host copies that open each step).
    frequent = max(count, key=count.get)
    mid = next((i for i in range(len(rows) // 2, len(rows)) if rows[i][2] == frequent),
               len(rows) // 2)
    print("\none stretch of a step: start (us from the first), duration, added to the path")
    t0 = rows[mid][0]
    for start, end, name, added in rows[mid:mid + 20]:
        print(f"  {(start - t0) / 1e3:8.2f} {(end - start) / 1e3:7.2f} {added / 1e3:7.2f}  {name}")


if __name__ == "__main__":
    main()
