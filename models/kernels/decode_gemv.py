"""GEMV for decode linears at tiny batch sizes, with the layer's neighbours optionally folded
in: `[x + residual ->] [RMSNorm ->] x @ W.T [+ bias] [-> SiLU-and-mul]`.

At batch 1 a linear is one pass over its weight, which cuBLAS's GEMM tiles stream at a fraction
of the bandwidth; folding in the add + norm and the activation saves their launches. Each
program owns BLOCK_N output columns of one row of x (with SILU_MUL, the gate rows and matching
up rows) and streams their weight along K in 16-byte vectors into float32 partials. With NORM
every program recomputes the row statistics (programs do not talk to each other); column tile 0
alone writes the new residual. Numerics round to the dtype at the torch path's points. With
PDL (sm_90+) everything before `gdc_wait` reads only weights. No host reads: graph-capturable.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns per program (with SILU_MUL: gate rows, and as many up rows)
    block_k: int  # K elements per loop step
    num_warps: int


def choose_config(n_out: int, k: int, dtype: torch.dtype, norm: bool = False) -> GemvConfig:
    """Launch shape from the problem alone. Two weight rows a program where the norm is folded
    in (halves the statistics passes) or N is vocabulary-sized; else one."""
    num_warps = 4 if k <= 2048 else 8
    block_k = min(triton.next_power_of_2(k), 4096 // dtype.itemsize)
    block_k = max(block_k, 16 // dtype.itemsize)
    block_n = 2 if (norm and n_out >= 2048) or n_out >= 65536 else 1
    return GemvConfig(block_n=block_n, block_k=block_k, num_warps=num_warps)


@functools.cache
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch: a Hopper-or-newer CUDA device, not Triton's interpreter."""
    if device.type != "cuda":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return _sm90_or_newer(device.index if device.index is not None
                          else torch.cuda.current_device())


@triton.jit
def _load(ptrs, k0, k_in, K, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(ptrs + k0)
    return tl.load(ptrs + k0, mask=k0 + k_in < K, other=0.0)


@triton.jit
def _load_sum(x_ptrs, r_ptrs, k0, k_in, K, HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr):
    """A tile of x (+ residual), added in float32 and rounded once, as torch's add is."""
    s = _load(x_ptrs, k0, k_in, K, EVEN_K)
    if HAS_RESIDUAL:
        r = _load(r_ptrs, k0, k_in, K, EVEN_K)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
    return s


@triton.jit
def _normalize(s, nw, rstd):
    """rms_norm's casts: normalized in float32, rounded, times the weight, rounded."""
    dtype = s.dtype
    normed = (s.to(tl.float32) * rstd).to(dtype)
    return (nw.to(tl.float32) * normed.to(tl.float32)).to(dtype)


@triton.jit
def _partials(w, h):
    """[BLOCK_N, KV] float32: the sum over each 16-byte vector stays inside its thread."""
    return tl.sum(w.to(tl.float32) * h.to(tl.float32), axis=2)


@triton.jit
def _decode_gemv_kernel(
    x_ptr, r_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, r_out_ptr,
    M, N, K, stride_xm, stride_rm, stride_om, stride_rom, eps,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr, EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SILU_MUL: tl.constexpr, PDL: tl.constexpr,
):
    """out[m, n] for n in this program's BLOCK_N columns; N: output columns (with SILU_MUL
    the weight has 2N rows, gate then up)."""
    pid = tl.program_id(0)
    tile = pid // M
    m = (pid % M).to(tl.int64)
    KV: tl.constexpr = BLOCK_K // VEC
    k_in = tl.arange(0, KV)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    k_in = k_in[None, :, :]  # [1, KV, VEC]
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    # The last tile re-reads row N - 1 rather than masking every weight load (stores are masked).
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None, None] * K + k_in  # [BLOCK_N, KV, VEC]
    up_ptrs = w_ptr + (rows + N)[:, None, None] * K + k_in  # SILU_MUL: the up half's rows
    x_ptrs = x_ptr + m * stride_xm + k_in  # [1, KV, VEC]
    r_ptrs = r_ptr + m * stride_rm + k_in

    # The first weight tile before anything else: no kernel writes weights, so with PDL it
    # loads while the previous kernel finishes, and its latency overlaps the norm's pass.
    w0 = _load(w_ptrs, 0, k_in, K, EVEN_K)
    if SILU_MUL:
        u0 = _load(up_ptrs, 0, k_in, K, EVEN_K)
    if PDL:
        tl.extra.cuda.gdc_wait()  # x and the residual come from earlier kernels
        tl.extra.cuda.gdc_launch_dependents()

    h = _load_sum(x_ptrs, r_ptrs, 0, k_in, K, HAS_RESIDUAL, EVEN_K)  # [1, KV, VEC]
    if NORM:
        # Column tile 0 writes the new residual; the other programs still read the old one.
        r_out_end = tl.where(tile == 0, K, 0)
        r_out_ptrs = r_out_ptr + m * stride_rom + k_in
        if HAS_RESIDUAL:
            tl.store(r_out_ptrs, h, mask=k_in < r_out_end)
        h32 = h.to(tl.float32)
        sum_sq = h32 * h32
        for k0 in range(BLOCK_K, K, BLOCK_K):
            s = _load_sum(x_ptrs, r_ptrs, k0, k_in, K, HAS_RESIDUAL, EVEN_K)
            if HAS_RESIDUAL:
                tl.store(r_out_ptrs + k0, s, mask=k0 + k_in < r_out_end)
            s32 = s.to(tl.float32)
            sum_sq += s32 * s32
        rstd = tl.math.rsqrt(tl.sum(sum_sq) / K + eps)
        h = _normalize(h, _load(nw_ptr + k_in, 0, k_in, K, EVEN_K), rstd)
    acc = _partials(w0, h)  # [BLOCK_N, KV]
    if SILU_MUL:
        acc_up = _partials(u0, h)
    # Names assigned in the loop are all new: one defined before it would be loop-carried.
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w_t = _load(w_ptrs, k0, k_in, K, EVEN_K)
        if SILU_MUL:
            u_t = _load(up_ptrs, k0, k_in, K, EVEN_K)
        h_t = _load_sum(x_ptrs, r_ptrs, k0, k_in, K, HAS_RESIDUAL, EVEN_K)
        if NORM:
            h_t = _normalize(h_t, _load(nw_ptr + k_in, k0, k_in, K, EVEN_K), rstd)
        acc += _partials(w_t, h_t)
        if SILU_MUL:
            acc_up += _partials(u_t, h_t)

    # The cross-lane/warp part of the K reduction, once; outputs rounded as F.linear's are.
    dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=1)  # [BLOCK_N] float32
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    y = y.to(dtype)
    if SILU_MUL:
        up = tl.sum(acc_up, axis=1)
        if HAS_BIAS:
            up += tl.load(b_ptr + N + rows).to(tl.float32)
        gate = y.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # F.silu, rounded
        y = (act.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + m * stride_om + offs_n, y, mask=offs_n < N)


def decode_gemv(
    x: torch.Tensor,  # [M, K], last dim contiguous
    weight: torch.Tensor,  # [N, K] contiguous, x's dtype; [2I, K] (gate | up) with silu_mul
    bias: torch.Tensor | None = None,  # [N] (or [2I])
    *,
    residual: torch.Tensor | None = None,  # [M, K]: added to x before the norm
    norm_weight: torch.Tensor | None = None,  # [K]: RMSNorm the (x + residual) row first
    eps: float = 1e-6,
    silu_mul: bool = False,
    config: GemvConfig | None = None,  # None: choose_config
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, s) for s = x [+ residual], h = rms_norm(s) if norm_weight else s,
    out = [silu_and_mul](F.linear(h, weight, bias)). s is a new tensor when residual is given
    (other programs still read x and residual), else x itself."""
    assert x.dim() == 2 and weight.dim() == 2, "x [M, K] and weight [N, K]"
    num_rows, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.is_contiguous(), (
        f"weight must be a contiguous [N, {k}] tensor, got {tuple(weight.shape)}")
    assert x.dtype == weight.dtype and x.dtype in DTYPES, (x.dtype, weight.dtype)
    assert x.stride(-1) == 1, "x's last dim must be contiguous"
    assert k >= 1 and n >= 1, f"empty GEMV: N={n}, K={k}"
    assert not silu_mul or n % 2 == 0, f"silu_mul needs an even number of weight rows, got {n}"
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), "bias must be [N]"
    n_out = n // 2 if silu_mul else n
    norm = norm_weight is not None
    if norm:
        assert norm_weight.shape == (k,) and norm_weight.stride(0) == 1, "norm_weight is [K]"
        assert norm_weight.dtype == x.dtype, (norm_weight.dtype, x.dtype)
    new_residual = x
    if residual is not None:
        assert norm, "the residual is added before the norm: pass norm_weight"
        assert residual.shape == x.shape and residual.dtype == x.dtype, residual.shape
        assert residual.stride(-1) == 1, "residual's last dim must be contiguous"
        new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    out = torch.empty(num_rows, n_out, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out, new_residual
    cfg = config or choose_config(n_out, k, x.dtype, norm)
    pdl = pdl_enabled(x.device)
    _decode_gemv_kernel[(triton.cdiv(n_out, cfg.block_n) * num_rows,)](
        x, residual if residual is not None else x, norm_weight if norm else x, weight,
        bias if bias is not None else x, out, new_residual,
        num_rows, n_out, k, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        new_residual.stride(0), eps,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, VEC=16 // x.element_size(),
        EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, NORM=norm,
        HAS_RESIDUAL=residual is not None, SILU_MUL=silu_mul, PDL=pdl,
        num_warps=cfg.num_warps, launch_pdl=pdl,
    )
    return out, new_residual
