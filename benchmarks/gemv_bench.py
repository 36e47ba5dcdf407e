"""GEMV micro-benchmark: cuBLAS (F.linear) against models/kernels/gemv.py at decode batch sizes.

    python -m benchmarks.gemv_bench [--models 0.6b,8b] [--tp 1,2,4] [--m 1,4,8]
                                    [--dtype bfloat16] [--rep 5] [--full]
    python -m benchmarks.gemv_bench --fused [--models 0.6b,8b] [--tp 1,2,4] [--dtype] [--rep]

For every Qwen3 decode linear (0.6B, 8B, and the 8B tensor-parallel shards: column-parallel
layers split N, row-parallel ones split K) and batch size M, times F.linear and every gemv config
candidate inside CUDA graphs (triton's do_bench_cudagraph, as decode runs). Each timed call reads
a different copy of the weight, cycling through >= 256 MiB of copies, so the weight comes from
HBM as in a real step (28-36 layers apart) rather than from the 50 MB L2. TB/s counts the weight
bytes only. Prints per (shape, M) the best config, then per shape the config that is fastest
over all M together, and last a `TUNED` table to paste into models/kernels/gemv.py (None where
cuBLAS was faster over all M).

`--fused` times models/kernels/fused_gemv.py at batch 1 instead, on the calls it would replace:
the add + RMSNorm (torch.compile, models.layers.fusion) -> `linear` [-> silu_and_mul] sequence
the model runs today against one fused_gemv per config, same cold weights and CUDA graphs. At
TP > 1 the norm is fused into the all-reduce, so the gate_up shards fold in SiLU-and-mul only.
Prints per shape the unfused time, the best fused config, and a `TUNED` table for fused_gemv.py.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch

# (model, layer, N, K, parallel style) at TP=1; "col" shards N, "row" shards K.
LAYERS = [
    ("0.6b", "qkv", 4096, 1024, "col"), ("0.6b", "o_proj", 1024, 2048, "row"),
    ("0.6b", "gate_up", 6144, 1024, "col"), ("0.6b", "down", 1024, 3072, "row"),
    ("0.6b", "lm_head", 151936, 1024, "col"),
    ("8b", "qkv", 6144, 4096, "col"), ("8b", "o_proj", 4096, 4096, "row"),
    ("8b", "gate_up", 24576, 4096, "col"), ("8b", "down", 4096, 12288, "row"),
    ("8b", "lm_head", 151936, 4096, "col"),
]
# Weight copies cycled per timed call: several times the H200's L2.
COLD_BYTES = 256 << 20
# (model, layer, N, K per rank, TP, norm, silu_mul): the batch-1 calls fused_gemv can replace.
# norm: the in-layer add + RMSNorm before the linear (residual given); silu: SiLU-and-mul after.
FUSED_CASES = [
    ("0.6b", "qkv", 4096, 1024, 1, True, False),
    ("0.6b", "gate_up", 6144, 1024, 1, True, True),
    ("8b", "qkv", 6144, 4096, 1, True, False),
    ("8b", "gate_up", 24576, 4096, 1, True, True),
    ("8b", "gate_up", 12288, 4096, 2, False, True),
    ("8b", "gate_up", 6144, 4096, 4, False, True),
]
EPS = 1e-6  # Qwen3's rms_norm_eps


def reference_shapes(models: list[str], tps: list[int]) -> list[tuple[str, int, int]]:
    """(label, N, K) per distinct shape; TP shards only for the 8B model (the 0.6B one runs at
    TP=1). Layers that share a shape share a row, labels joined by '='."""
    labels: dict[tuple[int, int], list[str]] = {}
    for model, layer, n, k, style in LAYERS:
        if model not in models:
            continue
        for tp in tps:
            if tp > 1 and model != "8b":
                continue
            shape = (n // tp, k) if style == "col" else (n, k // tp)
            labels.setdefault(shape, []).append(f"{model} {layer}" + (f" tp{tp}" if tp > 1
                                                                      else ""))
    return [("=".join(names), n, k) for (n, k), names in labels.items()]


def candidates(n: int, k: int, dtype: torch.dtype, num_sms: int, full: bool) -> list[Any]:
    """Config sweep for one shape. fma tiles put 32 lanes x num_warps x `reps` 16-byte vectors
    along K (the layout where every thread holds all BLOCK_N rows, so x is loaded once per row
    of x), mma tiles stage weight tiles through shared memory; split-K only where the row tiles
    alone give fewer than two programs per SM."""
    import triton

    from models.kernels.gemv import GemvConfig

    vec = 16 // dtype.itemsize
    max_k = max(16, triton.next_power_of_2(k))
    too_few = 2 * num_sms

    def splits(block_n: int, block_k: int) -> list[int]:
        tiles = triton.cdiv(n, block_n)
        return [s for s in (1, 2, 4, 8)
                if s == 1 or (tiles * s // 2 < too_few and triton.cdiv(k, block_k) >= s)]

    out = []
    warp_reps = [(2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2)] if full else [
        (4, 1), (8, 1), (4, 2)]
    for num_warps, reps in warp_reps:
        block_k = 32 * vec * num_warps * reps
        if block_k > max_k:
            continue
        for block_n in (1, 2, 4, 8):
            if block_n * reps > 8:
                continue
            for s in splits(block_n, block_k):
                out.append(GemvConfig(block_n, block_k, num_warps, s))
    stages = (3, 4, 6) if full else (4,)
    for block_n in (16, 32, 64) if full else (32, 64):
        for block_k in (64, 128, 256) if full else (128, 256):
            if block_k > max_k:
                continue
            for num_stages in stages:
                for s in splits(block_n, block_k):
                    out.append(GemvConfig(block_n, block_k, 4, s, "mma", num_stages))
    return out


def short(cfg: Any) -> str:
    s = f"{cfg.kind} n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps}"
    if cfg.kind == "mma":
        s += f" st{cfg.num_stages}"
    return s + (f" split{cfg.split_k}" if cfg.split_k > 1 else "")


def time_us(call: Callable[[torch.Tensor], Any], weights: list[torch.Tensor], rep: int
            ) -> float:
    """Microseconds per `call(weight)`, one call per weight copy per pass, replayed in a CUDA
    graph."""
    import triton.testing as tt

    def one_pass() -> None:
        for w in weights:
            call(w)

    bench = getattr(tt, "do_bench_cudagraph", tt.do_bench)
    return bench(one_pass, rep=rep) * 1e3 / len(weights)


def cold_weights(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Enough [N, K] weight copies that cycling through them reads each from HBM."""
    copies = max(1, -(-COLD_BYTES // (n * k * dtype.itemsize)))
    return [(torch.randn(n, k, device="cuda") / k**0.5).to(dtype) for _ in range(copies)]


def bench_shape(n: int, k: int, ms: list[int], dtype: torch.dtype, rep: int, full: bool
                ) -> tuple[dict[int, float], dict[Any, dict[int, float]]]:
    """(cuBLAS us per M, {config: us per M}) for one [N, K] weight; configs that fail to
    compile or give wrong answers are reported and left out."""
    import functools

    import torch.nn.functional as F

    from models.kernels.gemv import MAX_M, gemv, gemv_workspace

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    weights = cold_weights(n, k, dtype)
    workspace = gemv_workspace(MAX_M, n, "cuda")
    cublas, results = {}, {}
    for m in ms:
        x = torch.randn(m, k, device="cuda").to(dtype)
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        ref = F.linear(x.float(), weights[0].float())
        tol = 2e-2 * ref.abs().max().item()
        cublas[m] = time_us(functools.partial(F.linear, x), weights, rep)
        for cfg in candidates(n, k, dtype, num_sms, full):
            call = functools.partial(gemv, x, out=out, config=cfg, workspace=workspace)
            try:
                err = (call(weights[0]).float() - ref).abs().max().item()
                if not err <= tol:
                    raise AssertionError(f"max error {err:.3g} > {tol:.3g}")
                results.setdefault(cfg, {})[m] = time_us(call, weights, rep)
            except Exception as exc:  # a config that cannot run here is skipped, not fatal
                print(f"  N={n} K={k} M={m} {short(cfg)}: {type(exc).__name__}: "
                      f"{(str(exc).splitlines() or [''])[0][:120]}", file=sys.stderr)
    return cublas, results


def tbs(nbytes: int, us: float) -> float:
    return nbytes / us / 1e6


def main() -> None:
    from models.kernels.gemv import choose_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0.6b,8b")
    parser.add_argument("--tp", default="1,2,4", help="8B shards to include")
    parser.add_argument("--m", default="1,4,8", help="batch sizes (rows of x)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rep", type=int, default=5, help="do_bench rep (ms)")
    parser.add_argument("--full", action="store_true", help="the wider config sweep")
    parser.add_argument("--fused", action="store_true",
                        help="fused_gemv (add + RMSNorm / SiLU-and-mul folded in) against the "
                             "unfused sequence, batch 1 (--m and --full are not used)")
    args = parser.parse_args()
    if args.fused:
        main_fused(args)
        return
    dtype = getattr(torch, args.dtype)
    ms = [int(v) for v in args.m.split(",")]
    shapes = reference_shapes(args.models.split(","), [int(t) for t in args.tp.split(",")])
    print(f"GPU: {torch.cuda.get_device_name()}  dtype={args.dtype}  M={ms}  "
          f"torch {torch.__version__}")

    rows, chosen = [], []
    header = (f"{'shape':<34}{'N':>7}{'K':>7}{'M':>3}{'cuBLAS us':>11}{'TB/s':>6}  "
              f"{'best gemv config':<28}{'us':>8}{'TB/s':>6}{'speedup':>8}")
    for label, n, k in shapes:
        print(f"[{label}] N={n} K={k} ...", file=sys.stderr, flush=True)
        cublas, results = bench_shape(n, k, ms, dtype, args.rep, args.full)
        torch.cuda.empty_cache()  # this shape's weight copies
        nbytes = n * k * dtype.itemsize
        for m in ms:
            timed = [(r[m], cfg) for cfg, r in results.items() if m in r]
            if not timed:
                rows.append(f"{label:<34}{n:>7}{k:>7}{m:>3}{cublas[m]:>11.2f}"
                            f"{tbs(nbytes, cublas[m]):>6.2f}  no gemv config ran")
                continue
            us, cfg = min(timed, key=lambda t: t[0])
            rows.append(f"{label:<34}{n:>7}{k:>7}{m:>3}{cublas[m]:>11.2f}"
                        f"{tbs(nbytes, cublas[m]):>6.2f}  {short(cfg):<28}{us:>8.2f}"
                        f"{tbs(nbytes, us):>6.2f}{cublas[m] / us:>7.2f}x")
        everywhere = {cfg: r for cfg, r in results.items() if all(m in r for m in ms)}
        if everywhere:
            cfg = min(everywhere, key=lambda c: sum(everywhere[c].values()))
            chosen.append((label, n, k, cfg, everywhere[cfg], cublas,
                           everywhere.get(choose_config(n, k, dtype))))
        print("\n".join(rows[-len(ms):]), file=sys.stderr, flush=True)

    print("\nPer shape and M: cuBLAS against the best gemv config for that M")
    print(header)
    print("\n".join(rows))
    print_chosen(chosen, ms, dtype)


def config_literal(cfg: Any) -> str:
    """`GemvConfig(...)` source with the fields that differ from the defaults."""
    from dataclasses import fields

    parts = [f"{f.name}={getattr(cfg, f.name)!r}" for f in fields(cfg)
             if f.name in ("block_n", "block_k") or getattr(cfg, f.name) != f.default]
    return f"GemvConfig({', '.join(parts)})".replace("'", '"')


def print_chosen(chosen: list, ms: list[int], dtype: torch.dtype) -> None:
    """One config per shape (fastest summed over M) and the TUNED table to paste back."""
    print("\nChosen config per shape (fastest summed over M), its us and speedup over cuBLAS "
          "per M; 'default us' = today's choose_config summed over M (- if not in the sweep)")
    print(f"{'shape':<34}{'N':>7}{'K':>7}  {'config':<28}"
          + "".join(f"{f'M={m} us':>9}{'x':>7}" for m in ms) + f"{'default us':>11}")
    table = []
    for label, n, k, cfg, us, cublas, default in chosen:
        cells = "".join(f"{us[m]:>9.2f}{cublas[m] / us[m]:>6.2f}x" for m in ms)
        dflt = f"{sum(default.values()):>11.2f}" if default else f"{'-':>11}"
        print(f"{label:<34}{n:>7}{k:>7}  {short(cfg):<28}{cells}{dflt}")
        wins = sum(us.values()) < sum(cublas.values())
        speed = "/".join(f"{cublas[m] / us[m]:.2f}" for m in ms)
        table.append(f"    # {label}: {speed}x over cuBLAS at M={','.join(map(str, ms))}")
        table.append(f"    ({n}, {k}, {dtype.itemsize}): "
                     f"{config_literal(cfg) if wins else 'None'},")
    print("\n# models/kernels/gemv.py; None: cuBLAS was faster summed over M")
    print("TUNED: dict[tuple[int, int, int], GemvConfig | None] = {")
    print("\n".join(table))
    print("}")


# --------------------------------------------------------------------------- --fused


def fused_candidates(k: int, dtype: torch.dtype) -> list[Any]:
    """fused_gemv configs to time for one K: up to 8 columns per program, K tiles of 512-4096
    elements no wider than K (4096: the whole 8B hidden row in one tile, so x is read once),
    4 or 8 warps; not tiles too small to give every thread one 16-byte vector of weight."""
    from models.kernels.fused_gemv import FusedGemvConfig

    vec = 16 // dtype.itemsize
    return [FusedGemvConfig(block_n, block_k, num_warps)
            for block_k in (512, 1024, 2048, 4096) if block_k <= k
            for block_n in (1, 2, 4, 8) for num_warps in (4, 8)
            if block_n * block_k >= 32 * num_warps * vec]


def unfused_call(x: torch.Tensor, residual: torch.Tensor | None,
                 norm_weight: torch.Tensor | None, silu: bool
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`call(weight)`: the sequence the model runs today (add + RMSNorm and SiLU-and-mul
    through torch.compile, the linear through models.layers.linear.linear)."""
    from models.layers.activation import silu_and_mul
    from models.layers.fusion import fused
    from models.layers.layernorm import add_rms_norm
    from models.layers.linear import linear

    def call(weight: torch.Tensor) -> torch.Tensor:
        h = x
        if norm_weight is not None:
            h, _ = fused(add_rms_norm, x)(x, residual, norm_weight, EPS)
        y = linear(h, weight)
        return fused(silu_and_mul, y)(y) if silu else y

    return call


def bench_fused_case(n: int, k: int, norm: bool, silu: bool, dtype: torch.dtype, rep: int
                     ) -> tuple[float, dict[Any, float]]:
    """(unfused us, {config: fused us}) for one [N, K] weight at batch 1; configs that fail to
    compile or give wrong answers are reported and left out."""
    from models.kernels.fused_gemv import fused_gemv

    weights = cold_weights(n, k, dtype)
    x = torch.randn(1, k, device="cuda").to(dtype)
    residual = torch.randn(1, k, device="cuda").to(dtype) if norm else None
    norm_weight = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype) if norm else None
    out = torch.empty(1, n // 2 if silu else n, device="cuda", dtype=dtype)
    residual_out = torch.empty_like(x) if norm else None
    unfused = unfused_call(x, residual, norm_weight, silu)
    ref = unfused(weights[0]).float()  # also compiles the torch.compile'd parts
    tol = 2e-2 * ref.abs().max().item()
    unfused_us = time_us(unfused, weights, rep)
    results = {}
    for cfg in fused_candidates(k, dtype):
        def call(weight: torch.Tensor, cfg: Any = cfg) -> torch.Tensor:
            return fused_gemv(x, weight, norm_weight=norm_weight, eps=EPS, residual=residual,
                              silu_mul=silu, out=out, residual_out=residual_out, config=cfg)[0]

        try:
            err = (call(weights[0]).float() - ref).abs().max().item()
            if not err <= tol:
                raise AssertionError(f"max error {err:.3g} > {tol:.3g}")
            results[cfg] = time_us(call, weights, rep)
        except Exception as exc:  # a config that cannot run here is skipped, not fatal
            print(f"  N={n} K={k} {short_fused(cfg)}: {type(exc).__name__}: "
                  f"{(str(exc).splitlines() or [''])[0][:120]}", file=sys.stderr)
    return unfused_us, results


def short_fused(cfg: Any) -> str:
    return f"n{cfg.block_n} k{cfg.block_k} w{cfg.num_warps}"


def fused_label(model: str, layer: str, tp: int, norm: bool, silu: bool) -> str:
    folded = "+".join(["add+norm"] * norm + ["silu"] * silu)
    return f"{model} {layer}" + (f" tp{tp}" if tp > 1 else "") + f" ({folded})"


def main_fused(args: argparse.Namespace) -> None:
    from models.kernels.fused_gemv import choose_fused_config

    dtype = getattr(torch, args.dtype)
    models, tps = args.models.split(","), [int(t) for t in args.tp.split(",")]
    print(f"GPU: {torch.cuda.get_device_name()}  dtype={args.dtype}  M=1  "
          f"torch {torch.__version__}")
    print(f"{'shape':<34}{'N':>7}{'K':>6}{'unfused us':>12}  {'best fused':<16}{'us':>8}"
          f"{'speedup':>9}{'default us':>12}")
    table = []
    for model, layer, n, k, tp, norm, silu in FUSED_CASES:
        if model not in models or tp not in tps:
            continue
        label = fused_label(model, layer, tp, norm, silu)
        print(f"[{label}] N={n} K={k} ...", file=sys.stderr, flush=True)
        unfused_us, results = bench_fused_case(n, k, norm, silu, dtype, args.rep)
        torch.cuda.empty_cache()  # this shape's weight copies
        default = results.get(choose_fused_config(n, k, dtype, silu))
        dflt = f"{default:>12.2f}" if default else f"{'-':>12}"
        if not results:
            print(f"{label:<34}{n:>7}{k:>6}{unfused_us:>12.2f}  no fused config ran{dflt}")
            continue
        cfg = min(results, key=results.get)
        us = results[cfg]
        print(f"{label:<34}{n:>7}{k:>6}{unfused_us:>12.2f}  {short_fused(cfg):<16}{us:>8.2f}"
              f"{unfused_us / us:>8.2f}x{dflt}", flush=True)
        # Shapes where fusing lost stay in the table as comments, for the record.
        lost = "" if us < unfused_us else "# slower than unfused: "
        table.append(f"    # {label}: unfused {unfused_us:.2f} us -> fused {us:.2f} us")
        table.append(f"    {lost}({n}, {k}, {dtype.itemsize}, {silu}): FusedGemvConfig("
                     f"block_n={cfg.block_n}, block_k={cfg.block_k}, "
                     f"num_warps={cfg.num_warps}),")
    print("\n# models/kernels/fused_gemv.py")
    print("TUNED: dict[tuple[int, int, int, bool], FusedGemvConfig] = {")
    print("\n".join(table))
    print("}")


if __name__ == "__main__":
    main()
