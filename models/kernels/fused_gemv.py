"""Batch-1 GEMV with its decoder-layer neighbours folded in: `[add +] RMSNorm -> linear [->
SiLU-and-mul]` as one kernel for one token row.

At batch 1 a decoder layer is ~9 kernels of 1.5-5 us each plus a launch gap each, even inside a
CUDA graph. Two of them (the add + RMSNorm before qkv_proj and before gate_up_proj) and the
SiLU-and-mul after gate_up_proj touch a single [1, hidden] or [1, intermediate] row, so their
work is nothing next to the weight stream of the GEMV beside them; folding them in removes
their launches. Numerics are those of the unfused path (models.layers.layernorm.rms_norm,
F.linear, silu in float32), rounding to the dtype at the same points.

Tile: the "fma" layout of models/kernels/gemv.py. Each program owns BLOCK_N output columns
(with silu_mul: BLOCK_N gate rows n and the matching up rows N/2 + n, so the activation needs
no second pass) and streams their weight rows along K in `[BLOCK_N, BLOCK_K // VEC, VEC]`
tiles of 16-byte vectors into float32 per-thread partials, reduced across lanes once at the
end.

The norm needs statistics over all of K before any tile can be normalized, and programs do not
talk to each other, so every program computes them itself from x (+ residual), K elements read
from L2 (a first pass), then re-reads each tile of x in the GEMV loop. The first weight tile is
loaded before that pass, so its HBM latency hides behind it (with BLOCK_K >= K that is the
whole weight slice, and x is read once). Program 0 alone writes the new residual.

With `out` (and `residual_out`) given nothing is allocated and nothing is read back to the
host, so a call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from models.kernels.gemv import check_fma_tile, default_config
from models.kernels.pdl import pdl_for_weight, prefetch_weight_rows, wait_for_prior_kernel

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Largest K served: every program re-reads x (and the residual) over K from L2 for the norm's
# statistics, a cost that grows with K while the launch it saves does not.
MAX_K = 16384


@dataclass(frozen=True)
class FusedGemvConfig:
    """Launch choice of `fused_gemv`; a pure function of the shape via `choose_fused_config`."""

    block_n: int  # output columns per program (with silu_mul: gate rows, plus as many up rows)
    block_k: int  # K elements per inner-loop step
    num_warps: int = 4

    def __post_init__(self) -> None:
        check_fma_tile(self.block_n, self.block_k, self.num_warps)


# Measured winners per (N weight rows, K, element size in bytes, silu_mul), from
# `python -m benchmarks.gemv_bench --fused` on an H200; absent shapes take default_fused_config.
# Whether the norm is folded in is not part of the key: no Qwen3 shape is timed both ways.
TUNED: dict[tuple[int, int, int, bool], FusedGemvConfig] = {
    # Unfused = the compiled add-RMSNorm + linear() (+ the compiled SiLU-and-mul), us per call
    # at batch 1, cold weights, CUDA graphs (gemv_bench --fused --rep 3, H200, 2026-11-21).
    (4096, 1024, 2, False): FusedGemvConfig(block_n=2, block_k=1024),  # 0.6B qkv: 7.88 -> 5.10
    (6144, 1024, 2, True): FusedGemvConfig(block_n=2, block_k=512),  # 0.6B gate_up: 10.30 -> 6.57
    (6144, 4096, 2, False): FusedGemvConfig(block_n=2, block_k=2048),  # 8B qkv: 20.79 -> 17.40
    (24576, 4096, 2, True): FusedGemvConfig(block_n=2, block_k=2048),  # 8B gate_up: 57.08 -> 52.70
    # 8B gate_up shards at TP=2 / TP=4 (SiLU only; the norm is in the all-reduce kernel)
    (12288, 4096, 2, True): FusedGemvConfig(block_n=1, block_k=2048, num_warps=8),  # 29.17 -> 24.77
    (6144, 4096, 2, True): FusedGemvConfig(block_n=1, block_k=1024),  # 16.67 -> 13.96
}


def fused_gemv_tuned(n: int, k: int, dtype: torch.dtype, silu_mul: bool) -> bool:
    """Whether TUNED holds the shape, i.e. the fused kernel measured faster there than the
    unfused path (what the model asks before it takes the fused path)."""
    return (n, k, dtype.itemsize, silu_mul) in TUNED


def default_fused_config(n: int, k: int, dtype: torch.dtype, silu_mul: bool) -> FusedGemvConfig:
    """Unmeasured shapes: gemv's default tile for the outputs this kernel writes (with silu_mul
    each program's columns read a gate row and an up row)."""
    tile = default_config(n // 2 if silu_mul else n, k, dtype)
    return FusedGemvConfig(tile.block_n, tile.block_k, tile.num_warps)


def choose_fused_config(n: int, k: int, dtype: torch.dtype, silu_mul: bool) -> FusedGemvConfig:
    """n: the weight's rows (gate and up together with silu_mul)."""
    tuned = TUNED.get((n, k, dtype.itemsize, silu_mul))
    return tuned if tuned is not None else default_fused_config(n, k, dtype, silu_mul)


def fused_gemv_supported(x: torch.Tensor, weight: torch.Tensor, *,
                         norm_weight: torch.Tensor | None = None,
                         residual: torch.Tensor | None = None,
                         silu_mul: bool = False) -> bool:
    """True where `fused_gemv` can serve this call: CUDA, one row of x with a contiguous last
    dim, a contiguous [N, K] weight of x's dtype (bf16/fp16/fp32), K a multiple of 16 (so
    Triton knows the weight rows are 16-byte aligned) and at most MAX_K, N even with silu_mul,
    a [K] norm weight and a [1, K] residual (only with the norm) of x's dtype. It does not say
    whether the fused kernel is faster than the unfused path on this shape."""
    if not (x.is_cuda and weight.is_cuda) or x.dim() != 2 or weight.dim() != 2:
        return False
    n, k = weight.shape
    if x.shape != (1, k) or x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return False
    if x.stride(-1) != 1 or not weight.is_contiguous() or k % 16 or k > MAX_K or n < 1:
        return False
    if silu_mul and n % 2:
        return False
    if norm_weight is not None and (norm_weight.shape != (k,) or norm_weight.dtype != x.dtype
                                    or not norm_weight.is_cuda or norm_weight.stride(0) != 1):
        return False
    return residual is None or (norm_weight is not None and residual.shape == (1, k)
                                and residual.dtype == x.dtype and residual.is_cuda
                                and residual.stride(-1) == 1)


# --------------------------------------------------------------------------- kernel


@triton.jit
def _load(ptrs, k0, in_k, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs + k0)
    return tl.load(ptrs + k0, mask=in_k, other=0.0)


@triton.jit
def _load_s(x_ptrs, r_ptrs, k0, in_k, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr):
    """x (+ residual) tile, rounded once to the dtype as torch's add does. The add runs in
    float32 (then one rounding: the same result), as does all math here: Triton's interpreter
    would add bf16 bit patterns as integers."""
    s = _load(x_ptrs, k0, in_k, EVEN_K)
    if HAS_RESIDUAL:
        r = _load(r_ptrs, k0, in_k, EVEN_K)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
    return s


@triton.jit
def _normalize(s, nw, rstd):
    """rms_norm's casts: normalized in float32, rounded to the dtype, times the norm weight in
    the dtype (one more rounding)."""
    dtype = s.dtype
    normed = (s.to(tl.float32) * rstd).to(dtype)
    return (nw.to(tl.float32) * normed.to(tl.float32)).to(dtype)


@triton.jit
def _partials(w, h):
    """[BLOCK_N, KV] float32: the sum over each 16-byte vector stays inside its thread."""
    return tl.sum(w.to(tl.float32) * h.to(tl.float32), axis=2)


@triton.jit
def _fused_gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, out_ptr, r_out_ptr,
    n_out, K, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SILU_MUL: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    KV: tl.constexpr = BLOCK_K // VEC
    k_in = tl.arange(0, KV)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    k_in = k_in[None, :, :]  # [1, KV, VEC]
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    # The last tile re-reads row n_out - 1 instead of masking every weight load; its stores
    # are masked.
    rows = tl.minimum(offs_n, n_out - 1).to(tl.int64)
    gate_ptrs = w_ptr + rows[:, None, None] * K + k_in  # [BLOCK_N, KV, VEC]
    up_ptrs = w_ptr + (rows + n_out)[:, None, None] * K + k_in  # the up half's rows
    x_ptrs = x_ptr + k_in  # [1, KV, VEC]
    r_ptrs = r_ptr + k_in
    nw_ptrs = nw_ptr + k_in
    in_k = k_in < K

    if PDL:
        # Weights are never written by a kernel: L2 fetches this program's rows (one
        # contiguous slice, and its up half's) while the previous kernel finishes.
        row0 = pid * BLOCK_N
        num_rows = tl.minimum(n_out - row0, BLOCK_N)
        prefetch_weight_rows(w_ptr, row0, num_rows, K)
        if SILU_MUL:
            prefetch_weight_rows(w_ptr, row0 + n_out, num_rows, K)
    # Tile 0's weights first: their HBM latency overlaps the statistics pass below (and,
    # with PDL, the previous kernel's end).
    w_gate = _load(gate_ptrs, 0, in_k, EVEN_K)
    if SILU_MUL:
        w_up = _load(up_ptrs, 0, in_k, EVEN_K)
    wait_for_prior_kernel(PDL)  # x and the residual come from earlier kernels
    s = _load_s(x_ptrs, r_ptrs, 0, in_k, HAS_RESIDUAL, EVEN_K)  # [1, KV, VEC]
    if HAS_NORM:
        nw = _load(nw_ptrs, 0, in_k, EVEN_K)
        # Program 0 alone writes the new residual; other programs still read the old one.
        r_out_end = tl.where(pid == 0, K, 0)
        if HAS_RESIDUAL:
            tl.store(r_out_ptr + k_in, s, mask=k_in < r_out_end)
        s32 = s.to(tl.float32)
        sum_sq = s32 * s32  # [1, KV, VEC]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            s_k = _load_s(x_ptrs, r_ptrs, k0, k0 + k_in < K, HAS_RESIDUAL, EVEN_K)
            if HAS_RESIDUAL:
                tl.store(r_out_ptr + k0 + k_in, s_k, mask=k0 + k_in < r_out_end)
            s_k32 = s_k.to(tl.float32)
            sum_sq += s_k32 * s_k32
        rstd = tl.rsqrt(tl.sum(sum_sq) / K + eps)
        s = _normalize(s, nw, rstd)

    acc_gate = _partials(w_gate, s)  # [BLOCK_N, KV]
    if SILU_MUL:
        acc_up = _partials(w_up, s)
    # Names assigned in the loop are all new: one defined before it would be loop-carried.
    for k0 in range(BLOCK_K, K, BLOCK_K):
        in_kt = k0 + k_in < K
        w_gate_t = _load(gate_ptrs, k0, in_kt, EVEN_K)
        if SILU_MUL:
            w_up_t = _load(up_ptrs, k0, in_kt, EVEN_K)
        h_t = _load_s(x_ptrs, r_ptrs, k0, in_kt, HAS_RESIDUAL, EVEN_K)
        if HAS_NORM:
            h_t = _normalize(h_t, _load(nw_ptrs, k0, in_kt, EVEN_K), rstd)
        acc_gate += _partials(w_gate_t, h_t)
        if SILU_MUL:
            acc_up += _partials(w_up_t, h_t)

    # The cross-lane / cross-warp part of the K reduction, once per program; each linear
    # output rounded to the dtype as F.linear's would be.
    dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc_gate, axis=1).to(dtype)  # [BLOCK_N]
    if SILU_MUL:
        gate = y.to(tl.float32)
        up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    tl.store(out_ptr + offs_n, y, mask=offs_n < n_out)


# --------------------------------------------------------------------------- launcher


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + (a.shape[-1] - 1) * a.stride(-1) * a.element_size() + a.element_size()
    b1 = b0 + (b.shape[-1] - 1) * b.stride(-1) * b.element_size() + b.element_size()
    return a0 < b1 and b0 < a1


def fused_gemv(
    x: torch.Tensor,  # [1, K], last dim contiguous
    weight: torch.Tensor,  # [N, K] contiguous, x's dtype (bf16/fp16/fp32)
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: RMSNorm the input first
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,  # [1, K]: added before the norm (needs norm_weight)
    silu_mul: bool = False,  # weight is [gate (N/2 rows) | up (N/2 rows)]
    out: torch.Tensor | None = None,  # [1, N], or [1, N // 2] with silu_mul
    residual_out: torch.Tensor | None = None,  # [1, K], written when residual is given
    config: FusedGemvConfig | None = None,  # None: choose_fused_config
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, new_residual) of the unfused decode path for one token row:

        s = x + residual (rounded to the dtype), or x
        h = rms_norm(s, norm_weight, eps) if norm_weight is given, else s
        y = F.linear(h, weight)                          # float32 accumulation
        out = silu_and_mul(y) if silu_mul else y         # silu(gate) * up in float32

    new_residual is s written into residual_out when residual is given (never in place:
    other programs still read residual), else x itself. Allocates nothing when out (and
    residual_out, with a residual) are given."""
    assert x.dim() == 2 and x.shape[0] == 1, f"x must be [1, K], got {tuple(x.shape)}"
    k = x.shape[1]
    assert weight.dim() == 2 and weight.shape[1] == k and weight.is_contiguous(), (
        f"weight must be a contiguous [N, {k}] tensor, got {tuple(weight.shape)}")
    n = weight.shape[0]
    assert k >= 1 and n >= 1, f"empty GEMV: N={n}, K={k}"
    assert x.dtype == weight.dtype and x.dtype in _DTYPES, (
        f"x {x.dtype} and weight {weight.dtype} must match (bf16/fp16/fp32)")
    assert x.stride(-1) == 1, "x's last dim must be contiguous"
    assert not silu_mul or n % 2 == 0, f"silu_mul needs an even number of weight rows, got {n}"
    n_out = n // 2 if silu_mul else n
    if norm_weight is not None:
        assert norm_weight.shape == (k,) and norm_weight.stride(0) == 1, (
            f"norm_weight must be a contiguous [{k}] tensor, got {tuple(norm_weight.shape)}")
        assert norm_weight.dtype == x.dtype, (
            f"norm_weight {norm_weight.dtype} must have x's dtype {x.dtype}")
    if residual is None:
        assert residual_out is None, "residual_out is only written when residual is given"
    else:
        assert norm_weight is not None, "residual is added before the norm: pass norm_weight"
        assert residual.shape == (1, k) and residual.dtype == x.dtype, (
            f"residual must be [1, {k}] {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
        assert residual.stride(-1) == 1, "residual's last dim must be contiguous"
        if residual_out is None:
            residual_out = torch.empty_like(residual)
        assert residual_out.shape == (1, k) and residual_out.dtype == x.dtype, (
            f"residual_out must be [1, {k}] {x.dtype}, got {tuple(residual_out.shape)} "
            f"{residual_out.dtype}")
        assert residual_out.stride(-1) == 1, "residual_out's last dim must be contiguous"
        assert not _overlaps(residual_out, residual) and not _overlaps(residual_out, x), (
            "residual_out must not overlap x or residual: other programs still read them")
    if out is None:
        out = torch.empty(1, n_out, dtype=x.dtype, device=x.device)
    assert out.shape == (1, n_out) and out.dtype == x.dtype and out.stride(-1) == 1, (
        f"out must be [1, {n_out}] {x.dtype} with a contiguous last dim, "
        f"got {tuple(out.shape)} {out.dtype}")

    cfg = config or choose_fused_config(n, k, x.dtype, silu_mul)
    pdl = pdl_for_weight(x, weight)
    _fused_gemv_kernel[(triton.cdiv(n_out, cfg.block_n),)](
        x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, weight, out,
        residual_out if residual_out is not None else out,
        n_out, k, eps,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=16 // x.element_size(),
        EVEN_K=k % cfg.block_k == 0, HAS_NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None, SILU_MUL=silu_mul, PDL=pdl,
        num_warps=cfg.num_warps, launch_pdl=pdl,
    )
    return out, residual_out if residual is not None else x
