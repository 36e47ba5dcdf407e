"""Host work of a decode step with the model stubbed out: what scheduling, batch building,
sampling packs and postprocessing cost per step, on any machine (the device is not used).
`python -m benchmarks.host_step --model <tiny model dir> [--batch 256] [--steps 300]`."""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a model directory (e.g. nanoserve tiny-model)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--prompt-len", type=int, default=512)
    args = p.parse_args()
    from engine_service import LLM, SamplingParams
    from models.layers.sampler import SamplerOutput

    llm = LLM(args.model, device="cpu", dtype="float32", num_kv_blocks=20000,
              max_model_len=args.prompt_len + args.steps + 16)
    llm.tokenizer = None  # token ids in and out: no detokenization cost
    engine, runner = llm.engine, llm.engine.model_runner
    vocab = runner.vocab_size
    spent: dict[str, float] = defaultdict(float)

    def timed(obj, name: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0

        setattr(obj, name, wrapper)

    def run_model(batch):  # the batch is built; the forward pass is not run
        runner.prepare_inputs(batch)
        rows = sum(1 for item in batch if item.sample)
        return torch.zeros(rows, vocab) if rows else None

    runner.run_model = run_model
    runner.sampler = lambda logits, t: SamplerOutput(
        sampled_token_ids=torch.randint(0, vocab, (logits.shape[0],)))
    for obj, name in [(runner, "prepare_inputs"), (runner, "prepare_sampling"),
                      (engine.scheduler, "schedule"), (engine.scheduler, "postprocess"),
                      (engine, "_postprocess")]:
        timed(obj, name)
    prompts = [[(7 * i + j) % vocab for j in range(args.prompt_len)] for i in range(args.batch)]
    sp = SamplingParams(temperature=0.6, max_tokens=args.steps, ignore_eos=True, seed=0)
    llm.generate(prompts[:4], sp, use_tqdm=False)
    spent.clear()
    engine.total_stats.num_steps = 0
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    steps = engine.total_stats.num_steps
    print(f"batch {args.batch}: {steps} steps, {elapsed / steps * 1e3:.3f} ms of host work "
          f"per step (model stubbed out)")
    for name, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:18s} {seconds / steps * 1e3:7.3f} ms/step")


if __name__ == "__main__":
    main()
