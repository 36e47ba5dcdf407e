"""Host work of a decode step with the model stubbed out: what scheduling, batch building,
sampling packs and postprocessing cost per step, on any machine (the device is not used).
`python -m benchmarks.host_step --model <tiny model dir> [--batch 256] [--steps 300]`.

The headline figure is the steady-state decode step: one iteration of the offline loop
(`LLM._run`: engine.step() plus the per-output work), counted only when the step it
schedules and the step it finishes are both all-decode batches of the full batch, so the
prefill steps and the switch-over from them are left out. Wall and CPU time (this thread's)
are both given: on a shared machine the CPU time, and its 10th percentile, are the steadier.
The average over all steps (prefills included) follows."""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

# (object attribute, method) pairs timed inside each step; _postprocess includes postprocess.
PARTS = (("model_runner", "prepare_inputs"), ("model_runner", "prepare_sampling"),
         ("scheduler", "schedule"), ("scheduler", "postprocess"), (None, "_postprocess"))


class DecodeSteps:
    """Wraps engine.step and the PARTS methods; keeps the times of decode iterations."""

    def __init__(self, engine, batch: int) -> None:
        self.engine, self.batch = engine, batch
        self.wall_ms: list[float] = []
        self.cpu_ms: list[float] = []
        self.parts_s: dict[str, float] = defaultdict(float)  # summed over decode iterations
        self._step_parts: dict[str, float] = defaultdict(float)  # the current iteration's
        self._step = engine.step
        engine.step = self._timed_step
        for attr, name in PARTS:
            obj = engine if attr is None else getattr(engine, attr)
            setattr(obj, name, self._timed_part(name, getattr(obj, name)))
        self.reset()

    def reset(self) -> None:
        self.wall_ms.clear()
        self.cpu_ms.clear()
        self.parts_s.clear()
        self._t: tuple[float, float] | None = None
        self._decode = self._prev_decode = False

    def _timed_part(self, name: str, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._step_parts[name] += time.perf_counter() - t0
        return wrapper

    def _timed_step(self):
        now = time.perf_counter(), time.thread_time()
        if self._t is not None and self._decode and self._prev_decode:
            self.wall_ms.append((now[0] - self._t[0]) * 1e3)
            self.cpu_ms.append((now[1] - self._t[1]) * 1e3)
            for name, seconds in self._step_parts.items():
                self.parts_s[name] += seconds
        self._step_parts.clear()
        self._t = now
        engine = self.engine
        before = engine.total_stats.num_steps
        out = self._step()
        stats = engine.last_stats
        self._prev_decode = self._decode
        self._decode = (engine.total_stats.num_steps > before and stats.num_prefill_tokens == 0
                        and stats.num_decode_tokens == self.batch)
        return out

    def report(self) -> None:
        n = len(self.wall_ms)
        cpu = sorted(self.cpu_ms)
        print(f"batch {self.batch}: {n} decode steps, {statistics.median(self.wall_ms):.3f} ms "
              f"median wall ({statistics.median(cpu):.3f} ms CPU; CPU 10th percentile "
              f"{cpu[n // 10]:.3f} ms) of host work per decode step (model stubbed out)")
        for name, seconds in sorted(self.parts_s.items(), key=lambda kv: -kv[1]):
            print(f"  {name:18s} {seconds / n * 1e3:7.3f} ms/step (mean wall)")


def stub_model(runner) -> None:
    """Batches are still built (inputs and sampling packs); no forward pass, random tokens."""
    from models.layers.sampler import SamplerOutput

    vocab = runner.vocab_size

    def run_model(batch, *_, **__):
        runner.prepare_inputs(batch)
        rows = sum(1 for item in batch if item.sample)
        return torch.zeros(rows, vocab) if rows else None

    runner.run_model = run_model
    runner.sampler = lambda logits, t: SamplerOutput(
        sampled_token_ids=torch.randint(0, vocab, (logits.shape[0],)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a model directory (e.g. nanoserve tiny-model)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--profile", metavar="FILE",
                   help="write a cProfile of the timed run (prefills included) here")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1: no OpenMP spinning against other processes)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from engine_service import LLM, SamplingParams

    llm = LLM(args.model, device="cpu", dtype="float32", num_kv_blocks=20000,
              max_model_len=args.prompt_len + args.steps + 16)
    llm.tokenizer = None  # token ids in and out: no detokenization cost
    engine = llm.engine
    stub_model(engine.model_runner)
    timer = DecodeSteps(engine, args.batch)
    vocab = engine.model_runner.vocab_size
    prompts = [[(7 * i + j) % vocab for j in range(args.prompt_len)] for i in range(args.batch)]
    sp = SamplingParams(temperature=0.6, max_tokens=args.steps, ignore_eos=True, seed=0)
    llm.generate(prompts[:4], sp, use_tqdm=False)
    timer.reset()
    engine.total_stats.num_steps = 0
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    timer.report()
    steps = engine.total_stats.num_steps
    print(f"all {steps} steps (prefills included): {elapsed / steps * 1e3:.3f} ms per step")


if __name__ == "__main__":
    main()
