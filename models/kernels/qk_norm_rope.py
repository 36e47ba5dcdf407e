"""One Triton kernel for Qwen3's q_norm, k_norm, NeoX rotary and the KV-cache store.

Unfused, these are four to six launches per layer (two RMSNorms, rotary, store_kv); at decode
batch sizes their launch latency, not their few kilobytes of traffic, sets the step time.

Semantics are exactly those of the torch path, with the same casts in the same order:
`rms_norm` (float32 statistics, `weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)`), then
`apply_rotary` on the float32 values of the normed dtype-rounded heads (dims past
`rotary_dim` pass through), cast back to the model dtype; k (normed, rotated) and v (as is)
go to the paged cache `[num_blocks, block_size, num_kv_heads, head_dim]` at
`slot_mapping[t]` (slot -1: not stored).

Work split: program `(token, head)` over the `num_heads + num_kv_heads` heads of a token, so
a single decode token still spreads over H + Hkv programs instead of one program walking
every head. Heads `< num_heads` are query heads (written to `out`); the rest are KV heads
(k normed and rotated, v copied, both into the cache). The number of tokens is only the
grid's first dimension, never a kernel argument: one compile serves every batch size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels.pdl import pdl_enabled, wait_for_prior_kernel


@triton.jit
def _scale(x, rstd, weight_ptr, offs, DTYPE: tl.constexpr):
    # rms_norm's casts: the normalised value is rounded to the model dtype, then the weight is
    # applied in that dtype (i.e. a float32 product rounded once).
    w = tl.load(weight_ptr + offs).to(tl.float32)
    return (w * (x * rstd).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)


@triton.jit
def _norm_rope_head(row_ptr, weight_ptr, cos, sin, eps,
                    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr):
    """One head of HEAD_DIM contiguous values -> normed and rotated, in the model dtype."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    dtype = row_ptr.dtype.element_ty
    dims = tl.arange(0, HEAD_DIM)
    in_rot = dims < ROTARY_DIM
    first = dims < HALF
    # NeoX pairs dim d with d +- HALF; the partner is reloaded (same cache lines) and normed
    # with the same row statistic, rather than shuffling registers.
    partner = tl.where(in_rot, tl.where(first, dims + HALF, dims - HALF), dims)
    x = tl.load(row_ptr + dims).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    normed = _scale(x, rstd, weight_ptr, dims, dtype)
    normed_partner = _scale(tl.load(row_ptr + partner).to(tl.float32), rstd, weight_ptr,
                            partner, dtype)
    # First half: x1 * cos - x2 * sin; second half: x2 * cos + x1 * sin (same float32 ops).
    rot_partner = tl.where(first, -normed_partner, normed_partner)
    rotated = normed * cos + rot_partner * sin
    return tl.where(in_rot, rotated, normed).to(dtype)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr, out_ptr,
    stride_qkv_t, stride_out_t, stride_cos_sin, stride_cache_slot, stride_cache_head, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, PDL: tl.constexpr,
):
    HALF: tl.constexpr = ROTARY_DIM // 2
    wait_for_prior_kernel(PDL)  # qkv is the previous kernel's output
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.arange(0, HEAD_DIM)
    in_rot = dims < ROTARY_DIM
    freq = tl.where(dims < HALF, dims, dims - HALF)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cos_sin_row = cos_sin_ptr + pos * stride_cos_sin
    cos = tl.load(cos_sin_row + freq, mask=in_rot, other=1.0)
    sin = tl.load(cos_sin_row + HALF + freq, mask=in_rot, other=0.0)
    # q heads then k heads then v heads, each HEAD_DIM wide: head h starts at h * HEAD_DIM.
    row_ptr = qkv_ptr + t * stride_qkv_t + head * HEAD_DIM
    if head < NUM_HEADS:
        q = _norm_rope_head(row_ptr, q_weight_ptr, cos, sin, eps, HEAD_DIM, ROTARY_DIM)
        tl.store(out_ptr + t * stride_out_t + head * HEAD_DIM + dims,
                 q.to(out_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        # k is only ever consumed from the cache, so a skipped token needs no work at all.
        if slot >= 0:
            kv_head = head - NUM_HEADS
            k = _norm_rope_head(row_ptr, k_weight_ptr, cos, sin, eps, HEAD_DIM, ROTARY_DIM)
            cache_off = slot * stride_cache_slot + kv_head * stride_cache_head + dims
            tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty))
            v = tl.load(row_ptr + NUM_KV_HEADS * HEAD_DIM + dims)
            tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty))


def _num_warps(head_dim: int) -> int:
    # 4 elements a thread at head_dim 128: one warp per head is enough for a few hundred bytes.
    return max(1, min(8, head_dim // 128))


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                       head_dim: int, rotary_dim: int,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """q_norm + k_norm + NeoX rotary on q and k + store of k/v into the paged cache, in one
    launch. Returns q `[T, num_heads, head_dim]` (normed, rotated, model dtype).

    qkv: `[T, (H + 2 * Hkv) * D]` (q | k | v), any row stride, last dim contiguous.
    positions, slot_mapping: int64 `[T]` (slot -1: k/v of that token are not stored).
    cos_sin_cache: float32 `[max_pos, rotary_dim]` (cos | sin halves, RotaryEmbedding's).
    q_weight, k_weight: `[D]` in qkv's dtype. k_cache, v_cache: `[num_blocks, block_size, Hkv,
    D]` with linear slots (kv_cache[0] / kv_cache[1]). `out`: optional `[T, H, D]` contiguous
    buffer in qkv's dtype; with it the call allocates nothing (CUDA-graph capturable).
    """
    num_tokens, width = qkv.shape
    assert head_dim > 0 and head_dim & (head_dim - 1) == 0, (
        f"head_dim must be a power of two, got {head_dim}")
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim, (
        f"rotary_dim must be even and in (0, head_dim], got {rotary_dim}")
    assert width == (num_heads + 2 * num_kv_heads) * head_dim, (
        f"qkv width {width} != (H + 2 * Hkv) * D = {(num_heads + 2 * num_kv_heads) * head_dim}")
    assert qkv.stride(-1) == 1, "qkv's last dim must be contiguous"
    assert positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,), (
        "positions and slot_mapping must be [num_tokens]")
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == rotary_dim, (
        f"cos_sin_cache {tuple(cos_sin_cache.shape)} does not match rotary_dim {rotary_dim}")
    assert cos_sin_cache.stride(1) == 1 and cos_sin_cache.dtype == torch.float32
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        assert weight.shape == (head_dim,) and weight.stride(0) == 1, f"{name} must be [D]"
        # rms_norm's result dtype is weight * x's promotion: exact only when they agree.
        assert weight.dtype == qkv.dtype, f"{name} is {weight.dtype}, qkv is {qkv.dtype}"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache {tuple(k_cache.shape)} does not match (Hkv, D) = {(num_kv_heads, head_dim)}")
    assert k_cache.stride() == v_cache.stride(), "k_cache and v_cache strides differ"
    assert k_cache.stride(3) == 1, "cache head_dim must be contiguous"
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), "cache slots not linear"
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    assert out.shape == (num_tokens, num_heads, head_dim) and out.dtype == qkv.dtype, (
        f"out must be [T, H, D] = {(num_tokens, num_heads, head_dim)} {qkv.dtype}")
    assert out.stride(2) == 1 and out.stride(1) == head_dim, "out heads must be packed"
    if num_tokens == 0:
        return out
    pdl = pdl_enabled(qkv.device)
    _qk_norm_rope_store_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, positions, cos_sin_cache, q_weight, k_weight,
        k_cache, v_cache, slot_mapping, out,
        qkv.stride(0), out.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, PDL=pdl,
        num_warps=_num_warps(head_dim), launch_pdl=pdl,
    )
    return out
