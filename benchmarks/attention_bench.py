"""Attention micro-benchmark: the paged attention backends on one GPU.

    python -m benchmarks.attention_bench [--backends triton,flash-attn] [--dtype bfloat16]

Decode rows report the KV bytes read per second (the bound for decode), prefill and chunk
rows report causal attention TFLOP/s. Layouts are Qwen3-0.6B (16 heads, 8 KV heads, 128)
and Qwen3-8B (32, 8, 128). flash-attn runs with 256-token blocks (its paged minimum), the
others with --block-size.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from models.attention_metadata import AttentionMetadata, make_attention_metadata
from models.backends import get_attention_backend

Rows = list[tuple[int, int]]  # (cached_len, q_len) per row
Layout = tuple[int, int, int]  # (heads, kv_heads, head_dim)

LAYOUTS = {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}
SCENARIOS = {
    **{f"decode b={b} ctx={c}": [(c - 1, 1)] * b
       for b in (1, 8, 64, 256) for c in (1024, 8192)},
    "prefill 1x4096": [(0, 4096)],
    "prefill 8x1024": [(0, 1024)] * 8,
    "chunk 512 after 8k": [(8192, 512)] * 2,
    "mixed 64 decode + 1 chunk": [(2048, 1)] * 64 + [(4096, 1024)],
}


def _build(rows: Rows, layout: Layout, block_size: int, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    heads, kv_heads, dim = layout
    need = [-(-(c + q) // block_size) for c, q in rows]
    num_blocks = sum(need)
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(rows))]
    meta = make_attention_metadata([q for _, q in rows], [c + q for c, q in rows], tables,
                                   block_size, device="cuda")
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, dtype=dtype, device="cuda")
    query = torch.randn(sum(q for _, q in rows), heads, dim, dtype=dtype, device="cuda")
    return query, kv_cache, meta


def _work(rows: Rows, layout: Layout, dtype: torch.dtype) -> tuple[float, float]:
    """(KV bytes read, causal attention FLOPs) of one call."""
    heads, kv_heads, dim = layout
    elem = torch.tensor([], dtype=dtype).element_size()
    kv_bytes = sum(c + q for c, q in rows) * kv_heads * dim * 2 * elem
    flops = sum(4 * heads * dim * q * (c + (q + 1) / 2) for c, q in rows)
    return kv_bytes, flops


def _time_ms(backend: Any, rows: Rows, layout: Layout, block_size: int,
             dtype: torch.dtype) -> float:
    from triton.testing import do_bench

    query, kv_cache, meta = _build(rows, layout, block_size, dtype)
    scale = layout[2] ** -0.5
    return do_bench(lambda: backend.forward(query, kv_cache, meta, scale))


def _decode_case(rows: Rows, layout: Layout, block_size: int, dtype: torch.dtype
                 ) -> tuple[Any, Callable[[Any], float]]:
    """Decode rows as the engine launches them: (the launch choose_launch picks, a function
    timing any launch on these rows in KV TB/s). Counters are kept across calls as the
    backend keeps them, so no call pays a memset."""
    from triton.testing import do_bench

    from models.kernels.paged_attention import choose_launch, paged_attention, split_counters

    heads, kv_heads, dim = layout
    query, kv_cache, meta = _build(rows, layout, block_size, dtype)
    kv_bytes, _ = _work(rows, layout, dtype)
    counters = split_counters(1 << 16, "cuda")
    chosen = choose_launch(num_tokens=len(rows), num_seqs=len(rows), num_kv_heads=kv_heads,
                           num_q_per_kv=heads // kv_heads, dtype=dtype, max_query_len=1,
                           max_seq_len=0, decode_only=True,
                           num_sms=torch.cuda.get_device_properties(0).multi_processor_count)

    def tb_per_s(launch: Any) -> float:
        ms = do_bench(functools.partial(
            paged_attention, query, kv_cache[0], kv_cache[1], meta.cu_seqlens_q,
            meta.seq_lens, meta.block_tables, dim ** -0.5, launch, counters=counters))
        return kv_bytes / ms / 1e9

    return chosen, tb_per_s


def sweep_splits(layout: Layout, block_size: int, dtype: torch.dtype) -> None:
    """Decode attention at each (split count, least partition length), over batches whose
    contexts spread like the nano-vllm bench workload's (uniform 100..2048) and over equal
    contexts, to tune choose_launch's split rule. Prints one line per batch, contexts and
    least partition length, then per batch the best cell next to the chosen launch."""
    import random

    rng = random.Random(0)
    print(f"{'batch':>6}{'contexts':>12}{'min len':>8}" + "".join(f"{f'S={s}':>9}"
                                                              for s in SPLITS))
    summary = []
    for batch in (1, 8, 16, 32, 48, 64, 96, 128, 192, 256):
        for ctx_name, ctx in (("100..2048", lambda: rng.randint(100, 2048)),
                              ("1024", lambda: 1024)):
            base, tb_per_s = _decode_case([(ctx() - 1, 1) for _ in range(batch)], layout,
                                          block_size, dtype)
            cells = {}
            for min_len in SPLIT_LENS:
                for splits in SPLITS:
                    if splits == 1 and min_len:
                        continue  # unsplit launches ignore the length
                    # The chosen launch with only the split rule changed (its warps and
                    # K/V prefetch kept: they go with the small decode launches).
                    cells[splits, min_len] = tb_per_s(
                        replace(base, num_splits=splits, min_split_len=min_len))
                print(f"{batch:>6}{ctx_name:>12}{min_len:>8}" + "".join(
                    f"{cells[s, min_len]:>8.2f}T" if (s, min_len) in cells else f"{'':>9}"
                    for s in SPLITS))
            (best_s, best_len), best = max(cells.items(), key=lambda kv: kv[1])
            summary.append(f"{batch:>6}{ctx_name:>12}  best S={best_s} len={best_len} "
                           f"{best:.2f}T; chosen S={base.num_splits} len={base.min_split_len} "
                           f"{tb_per_s(base):.2f}T")
    print("\n".join(summary))


SPLITS = (1, 2, 4, 8, 16, 32)
SPLIT_LENS = (0, 256, 512, 1024)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="triton,flash-attn")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--sweep-splits", action="store_true",
                        help="decode KV bandwidth (TB/s) per split count instead")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"GPU: {torch.cuda.get_device_name()}  dtype={args.dtype}")
    if args.sweep_splits:
        for layout_name in args.layouts.split(","):
            print(f"triton decode, {layout_name}, block size {args.block_size}: KV TB/s")
            sweep_splits(LAYOUTS[layout_name], args.block_size, dtype)
        return
    print(f"{'backend':<11}{'layout':<12}{'scenario':<28}{'us':>10}{'GB/s':>9}{'TFLOP/s':>9}")
    for name in args.backends.split(","):
        try:
            backend = get_attention_backend(name, "cuda")
        except (ValueError, ImportError) as exc:
            print(f"{name:<11}skipped: {exc}")
            continue
        block_size = 256 if name == "flash-attn" else args.block_size
        for layout_name in args.layouts.split(","):
            layout = LAYOUTS[layout_name]
            for scenario, rows in SCENARIOS.items():
                ms = _time_ms(backend, rows, layout, block_size, dtype)
                kv_bytes, flops = _work(rows, layout, dtype)
                print(f"{name:<11}{layout_name:<12}{scenario:<28}{ms * 1e3:>10.1f}"
                      f"{kv_bytes / ms / 1e6:>9.0f}{flops / ms / 1e9:>9.1f}")


if __name__ == "__main__":
    main()
