"""Microbenchmark of the per-step kernels outside the linears and attention: the fused
sampler (`race_argmax`) and q/k-norm + rotary + KV store (`qk_norm_rope_store`), at decode
batch sizes, replayed in CUDA graphs (`triton.testing.do_bench_cudagraph`).

    python -m benchmarks.step_kernels_bench [--batches 1,64,256]

The q/k-norm kernel runs at its chosen heads per program and at one head per program, so the
table shows what grouping heads buys at each batch size.
"""

from __future__ import annotations

import argparse

import torch

VOCAB = 151_936  # Qwen3
# (label, q heads, kv heads) of one rank; head_dim 128.
LAYOUTS = (("qwen3-0.6b", 16, 8), ("qwen3-8b tp4", 8, 2))


def _us(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=50) * 1e3


def bench_sampler(batch: int) -> tuple[float, float]:
    """(us a call with temperature 0.6, us a call greedy)."""
    from models.kernels.sample import race_argmax

    logits = torch.randn(batch, VOCAB, device="cuda").to(torch.bfloat16)
    seeds = torch.arange(batch, device="cuda", dtype=torch.int64)
    steps = torch.zeros(batch, device="cuda", dtype=torch.int64)
    sampled = torch.full((batch,), 0.6, device="cuda")
    greedy = torch.zeros(batch, device="cuda")
    return (_us(lambda: race_argmax(logits, sampled, seeds, steps)),
            _us(lambda: race_argmax(logits, greedy, seeds, steps)))


def bench_qk_norm_rope(tokens: int, heads: int, kv_heads: int,
                       heads_per_program: int | None) -> float:
    from models.kernels.qk_norm_rope import qk_norm_rope_store

    dim, block_size = 128, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, device="cuda").to(torch.bfloat16)
    positions = torch.arange(tokens, device="cuda") + 700
    cos_sin = torch.randn(4096, dim, device="cuda")
    q_w = torch.ones(dim, device="cuda", dtype=torch.bfloat16)
    k_w = torch.ones(dim, device="cuda", dtype=torch.bfloat16)
    num_blocks = tokens // block_size + 1
    cache = torch.empty(2, num_blocks, block_size, kv_heads, dim, device="cuda",
                        dtype=torch.bfloat16)
    slots = torch.randperm(num_blocks * block_size, device="cuda")[:tokens]
    out = torch.empty(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    return _us(lambda: qk_norm_rope_store(
        qkv, positions, cos_sin, q_w, k_w, 1e-6, cache[0], cache[1], slots, heads, kv_heads,
        dim, dim, out=out, heads_per_program=heads_per_program))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,64,256")
    args = p.parse_args()
    from models.kernels.qk_norm_rope import choose_heads_per_program

    batches = [int(b) for b in args.batches.split(",")]
    print(f"GPU: {torch.cuda.get_device_name()}")
    print("| kernel | batch | us a call |\n|---|---|---|")
    for batch in batches:
        sampled, greedy = bench_sampler(batch)
        print(f"| race_argmax, vocab {VOCAB}, T=0.6 / greedy | {batch} | "
              f"{sampled:.1f} / {greedy:.1f} |")
    for label, heads, kv_heads in LAYOUTS:
        for batch in batches:
            chosen = choose_heads_per_program(batch, heads, kv_heads)
            ours = bench_qk_norm_rope(batch, heads, kv_heads, None)
            one = bench_qk_norm_rope(batch, heads, kv_heads, 1)
            print(f"| qk_norm_rope_store {label}, {chosen} heads a program (1 head) | {batch} "
                  f"| {ours:.2f} ({one:.2f}) |")


if __name__ == "__main__":
    main()
