"""One Triton launch between qkv_proj and attention: optional per-head RMSNorm of q and k
(Qwen3's q_norm / k_norm), NeoX rotary of q and k, and the store of k and v into the paged cache
(slot -1: not stored). Unfused these are three to six launches per layer, whose latency sets
their time at decode. Numerics are the torch path's (rms_norm, apply_rotary), same casts in the
same order.

Program `(token, head block)` takes HEADS consecutive heads of the `H + Hkv` as one tile: q
blocks write `out`, kv blocks write the cache. Small batches use HEADS = 1 to spread a decode
token over many programs; large ones group heads so the dependent loads (position -> cos/sin,
slot) are paid once per block. One compile per HEADS serves every batch size.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# One-head programs up to this many in the grid; beyond it heads are grouped.
HEAD_BLOCK_MIN_PROGRAMS = 1536
# At most this many heads a program (one warp each at head_dim 128; 8 warps is the cap).
MAX_HEADS_PER_PROGRAM = 8


def choose_heads_per_program(num_tokens: int, num_heads: int, num_kv_heads: int) -> int:
    """1 for small grids, else the largest power of two <= MAX_HEADS_PER_PROGRAM dividing
    both head counts (so a block is all q heads or all kv heads)."""
    if num_tokens * (num_heads + num_kv_heads) < HEAD_BLOCK_MIN_PROGRAMS:
        return 1
    common = math.gcd(num_heads, num_kv_heads)
    return min(MAX_HEADS_PER_PROGRAM, common & -common)


def rope_store_supported(head_dim: int, rotary_dim: int) -> bool:
    """Head sizes the kernel serves: a power-of-two head_dim (a tile's width) and an even
    rotary_dim in (0, head_dim]."""
    return (head_dim > 0 and head_dim & (head_dim - 1) == 0
            and rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim)


@triton.jit
def _norm_rope_heads(rows_ptr, weight_ptr, cos, sin, eps, HAS_NORM: tl.constexpr,
                     HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr):
    """[HEADS, 1] head pointers -> [HEADS, HEAD_DIM] (normed and) rotated, input dtype;
    cos, sin: [1, HEAD_DIM] float32, 1 and 0 past ROTARY_DIM."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    dtype = rows_ptr.dtype.element_ty
    dims = tl.arange(0, HEAD_DIM)
    in_rot = dims < ROTARY_DIM
    first = dims < HALF
    # NeoX pairs dim d with d +- HALF: the partner is reloaded (same cache lines) rather than
    # shuffled between registers, and normed with the same row statistic.
    partner = tl.where(in_rot, tl.where(first, dims + HALF, dims - HALF), dims)
    x = tl.load(rows_ptr + dims[None, :]).to(tl.float32)  # [HEADS, HEAD_DIM]
    xp = tl.load(rows_ptr + partner[None, :]).to(tl.float32)
    if HAS_NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]  # [HEADS, 1]
        w = tl.load(weight_ptr + dims).to(tl.float32)[None, :]
        wp = tl.load(weight_ptr + partner).to(tl.float32)[None, :]
        # rms_norm's casts: normalized in float32, rounded to the dtype, weight applied in it.
        x = (w * (x * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        xp = (wp * (xp * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    # First half: x1 * cos - x2 * sin; second half: x2 * cos + x1 * sin.
    rotated = tl.where(first[None, :], x * cos - xp * sin, x * cos + xp * sin)
    return tl.where(in_rot[None, :], rotated, x).to(dtype)


@triton.jit
def _rope_store_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr, out_ptr,
    stride_qkv_t, stride_out_t, stride_cos_sin, stride_cache_slot, stride_cache_head, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, HAS_QK_NORM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    heads = head_block * HEADS + tl.arange(0, HEADS)  # [HEADS]: q heads, then kv heads
    dims = tl.arange(0, HEAD_DIM)

    # The token's cos/sin row, laid out per dim: NeoX halves share a frequency.
    HALF: tl.constexpr = ROTARY_DIM // 2
    in_rot = dims < ROTARY_DIM
    freq = tl.where(dims < HALF, dims, dims - HALF)
    cs_row = cos_sin_ptr + tl.load(positions_ptr + t).to(tl.int64) * stride_cos_sin
    cos = tl.load(cs_row + freq, mask=in_rot, other=1.0)[None, :]  # [1, HEAD_DIM]
    sin = tl.load(cs_row + HALF + freq, mask=in_rot, other=0.0)[None, :]

    # q | k | v heads, each HEAD_DIM wide: head h starts at h * HEAD_DIM.
    rows_ptr = qkv_ptr + t * stride_qkv_t + heads[:, None] * HEAD_DIM  # [HEADS, 1]
    if head_block < NUM_HEADS // HEADS:
        q = _norm_rope_heads(rows_ptr, q_weight_ptr, cos, sin, eps, HAS_QK_NORM,
                             HEAD_DIM, ROTARY_DIM)
        out_offs = t * stride_out_t + heads[:, None] * HEAD_DIM + dims[None, :]
        tl.store(out_ptr + out_offs, q.to(out_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        # k is only ever read back from the cache: a skipped token needs no work at all.
        if slot >= 0:
            k = _norm_rope_heads(rows_ptr, k_weight_ptr, cos, sin, eps, HAS_QK_NORM,
                                 HEAD_DIM, ROTARY_DIM)
            cache_offs = (slot * stride_cache_slot
                          + (heads - NUM_HEADS)[:, None] * stride_cache_head + dims[None, :])
            tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty))
            v = tl.load(rows_ptr + NUM_KV_HEADS * HEAD_DIM + dims[None, :])
            tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty))


def rope_store_kernel(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      rotary_dim: int, q_norm_weight: torch.Tensor | None,
                      k_norm_weight: torch.Tensor | None, eps: float,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                      head_dim: int, *, heads_per_program: int | None = None) -> torch.Tensor:
    """Returns q `[T, num_heads, head_dim]`, k / v stored. qkv: `[T, (H + 2 * Hkv) * D]`;
    positions, slot_mapping: `[T]`; cos_sin_cache: float32 `[max_pos, rotary_dim]`; norm
    weights: both `[D]` in qkv's dtype or both None; caches `[num_blocks, block_size, Hkv, D]`.
    """
    num_tokens, width = qkv.shape
    assert width == (num_heads + 2 * num_kv_heads) * head_dim, (
        f"qkv width {width} != (H + 2 * Hkv) * D = {(num_heads + 2 * num_kv_heads) * head_dim}")
    assert qkv.stride(-1) == 1, "qkv's last dim must be contiguous"
    assert rope_store_supported(head_dim, rotary_dim), (head_dim, rotary_dim)
    assert positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,), (
        "positions and slot_mapping must be [num_tokens]")
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == rotary_dim, (
        f"cos_sin_cache {tuple(cos_sin_cache.shape)} does not match rotary_dim {rotary_dim}")
    assert cos_sin_cache.stride(1) == 1 and cos_sin_cache.dtype == torch.float32
    has_norm = q_norm_weight is not None
    assert (k_norm_weight is not None) == has_norm, "pass both q/k norm weights or neither"
    for weight in (q_norm_weight, k_norm_weight) if has_norm else ():
        assert weight.shape == (head_dim,) and weight.stride(0) == 1, "norm weights are [D]"
        # rms_norm's result dtype is the promotion of weight and x: exact only when they agree.
        assert weight.dtype == qkv.dtype, f"norm weight {weight.dtype}, qkv {qkv.dtype}"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache {tuple(k_cache.shape)} does not match (Hkv, D) = {(num_kv_heads, head_dim)}")
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1), "cache slots not linear"
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return out
    heads = (choose_heads_per_program(num_tokens, num_heads, num_kv_heads)
             if heads_per_program is None else heads_per_program)
    assert heads > 0 and heads & (heads - 1) == 0, heads
    assert num_heads % heads == 0 and num_kv_heads % heads == 0, (
        f"heads_per_program {heads} must divide H = {num_heads} and Hkv = {num_kv_heads}")
    dummy = qkv  # stands in for absent norm weights (never read)
    _rope_store_kernel[(num_tokens, (num_heads + num_kv_heads) // heads)](
        qkv, positions, cos_sin_cache,
        q_norm_weight if has_norm else dummy, k_norm_weight if has_norm else dummy,
        k_cache, v_cache, slot_mapping, out,
        qkv.stride(0), out.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS=heads,
        HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, HAS_QK_NORM=has_norm,
        # About a warp a head at head_dim 128 (a few hundred bytes each).
        num_warps=min(8, heads * max(1, head_dim // 128)),
    )
    return out
