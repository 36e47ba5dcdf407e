"""One Triton kernel for Qwen3's q_norm, k_norm, NeoX rotary and the KV-cache store.

Unfused, these are four to six launches per layer (two RMSNorms, rotary, store_kv); at decode
batch sizes their launch latency, not their few kilobytes of traffic, sets the step time.

Semantics are exactly those of the torch path, with the same casts in the same order:
`rms_norm` (float32 statistics, `weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)`), then
`apply_rotary` on the float32 values of the normed dtype-rounded heads (dims past
`rotary_dim` pass through), cast back to the model dtype; k (normed, rotated) and v (as is)
go to the paged cache `[num_blocks, block_size, num_kv_heads, head_dim]` at
`slot_mapping[t]` (slot -1: not stored).

Work split: program `(token, head block)` over the `num_heads + num_kv_heads` heads of a
token, HEADS consecutive heads a block as one `[HEADS, head_dim]` tile (about a warp a head).
Heads `< num_heads` are query heads (written to `out`); the rest are KV heads (k normed and
rotated, v copied, both into the cache); HEADS divides both counts, so a block is all one
kind. Small batches use HEADS = 1, so a single decode token still spreads over H + Hkv
programs instead of one program walking every head; large ones group heads so the per-program
chain of dependent loads (position, cos/sin, slot, weights) is paid once per block rather
than once per head (`choose_heads_per_program`). The number of tokens is only the grid's first
dimension, never a kernel argument: one compile per HEADS (two per layout) serves every batch
size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
def rope_cos_sin(cos_sin_ptr, position_ptr, stride_cos_sin, HEAD_DIM: tl.constexpr,
                 ROTARY_DIM: tl.constexpr):
    """cos, sin [1, HEAD_DIM] float32 of the token at *position_ptr, laid out for
    norm_rope_heads: NeoX halves share a frequency; 1 and 0 past ROTARY_DIM."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    dims = tl.arange(0, HEAD_DIM)
    in_rot = dims < ROTARY_DIM
    freq = tl.where(dims < HALF, dims, dims - HALF)
    row = cos_sin_ptr + tl.load(position_ptr).to(tl.int64) * stride_cos_sin
    cos = tl.load(row + freq, mask=in_rot, other=1.0)[None, :]
    sin = tl.load(row + HALF + freq, mask=in_rot, other=0.0)[None, :]
    return cos, sin


@triton.jit
def norm_rope_heads(rows_ptr, weight_ptr, cos, sin, eps,
                    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr):
    """HEADS heads of HEAD_DIM contiguous values each -> normed and rotated, in the model
    dtype. rows_ptr: [HEADS, 1] pointers to each head's first value; cos, sin: [1, HEAD_DIM]
    float32 (1 and 0 past ROTARY_DIM)."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    dtype = rows_ptr.dtype.element_ty
    dims = tl.arange(0, HEAD_DIM)
    in_rot = dims < ROTARY_DIM
    first = dims < HALF
    # NeoX pairs dim d with d +- HALF; the partner is reloaded (same cache lines) and normed
    # with the same row statistic, rather than shuffling registers.
    partner = tl.where(in_rot, tl.where(first, dims + HALF, dims - HALF), dims)
    x = tl.load(rows_ptr + dims[None, :]).to(tl.float32)  # [HEADS, HEAD_DIM]
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]  # [HEADS, 1]
    normed = _scale(x, rstd, weight_ptr, dims[None, :], dtype)
    normed_partner = _scale(tl.load(rows_ptr + partner[None, :]).to(tl.float32), rstd,
                            weight_ptr, partner[None, :], dtype)
    # First half: x1 * cos - x2 * sin; second half: x2 * cos + x1 * sin (same float32 ops).
    rot_partner = tl.where(first[None, :], -normed_partner, normed_partner)
    rotated = normed * cos + rot_partner * sin
    return tl.where(in_rot[None, :], rotated, normed).to(dtype)


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr, out_ptr,
    stride_qkv_t, stride_out_t, stride_cos_sin, stride_cache_slot, stride_cache_head, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_prior_kernel(PDL)  # qkv is the previous kernel's output
    t = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    heads = head_block * HEADS + tl.arange(0, HEADS)  # [HEADS], q heads then kv heads
    dims = tl.arange(0, HEAD_DIM)
    # One cos/sin row serves all HEADS heads of the token.
    cos, sin = rope_cos_sin(cos_sin_ptr, positions_ptr + t, stride_cos_sin, HEAD_DIM,
                            ROTARY_DIM)
    # q heads then k heads then v heads, each HEAD_DIM wide: head h starts at h * HEAD_DIM.
    rows_ptr = qkv_ptr + t * stride_qkv_t + heads[:, None] * HEAD_DIM  # [HEADS, 1]
    # HEADS divides NUM_HEADS (and NUM_KV_HEADS): a block is all q heads or all kv heads.
    if head_block < NUM_HEADS // HEADS:
        q = norm_rope_heads(rows_ptr, q_weight_ptr, cos, sin, eps, HEAD_DIM, ROTARY_DIM)
        out_offs = t * stride_out_t + heads[:, None] * HEAD_DIM + dims[None, :]
        tl.store(out_ptr + out_offs, q.to(out_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
        # k is only ever consumed from the cache, so a skipped token needs no work at all.
        if slot >= 0:
            kv_heads = heads - NUM_HEADS
            k = norm_rope_heads(rows_ptr, k_weight_ptr, cos, sin, eps, HEAD_DIM, ROTARY_DIM)
            cache_offs = (slot * stride_cache_slot + kv_heads[:, None] * stride_cache_head
                          + dims[None, :])  # [HEADS, HEAD_DIM]
            tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty))
            v = tl.load(rows_ptr + NUM_KV_HEADS * HEAD_DIM + dims[None, :])
            tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty))


# One-head programs (num_tokens x (H + Hkv), one warp each) from which heads are grouped.
# Each program is a short chain of dependent loads (position -> cos/sin, slot, row, partner,
# weights); once the grid overflows a resident wave that chain is paid again and again, and
# grouping pays; below it the one-head split keeps every head in flight at once. Measured
# (`benchmarks.step_kernels_bench`, H200, bf16, us a call, grouped vs one head): Qwen3-0.6B
# (24 heads) T=64 1.78 vs 2.23, T=128 2.17 vs 4.10, T=256 2.47 vs 7.78; Qwen3-8B TP=4 (10
# heads) T=64 1.76 vs 1.53, T=128 1.86 vs 1.90, T=256 2.01 vs 3.43.
HEAD_BLOCK_MIN_PROGRAMS = 1536
# Heads per program at most: one warp each, a block of 8 warps (num_warps' cap).
MAX_HEADS_PER_PROGRAM = 8


def choose_heads_per_program(num_tokens: int, num_heads: int, num_kv_heads: int) -> int:
    """Heads one program handles: 1 for small grids, else the largest power of two
    <= MAX_HEADS_PER_PROGRAM dividing both head counts (a block is all q or all kv)."""
    if num_tokens * (num_heads + num_kv_heads) < HEAD_BLOCK_MIN_PROGRAMS:
        return 1
    common = math.gcd(num_heads, num_kv_heads)
    return min(MAX_HEADS_PER_PROGRAM, common & -common)


def _num_warps(head_dim: int, heads: int = 1) -> int:
    # 4 elements a thread at head_dim 128: about one warp per head is enough for a few hundred
    # bytes.
    return min(8, heads * max(1, head_dim // 128))


def _check_norm_rope_args(num_tokens: int, dtype: torch.dtype, head_dim: int, rotary_dim: int,
                          positions: torch.Tensor, slot_mapping: torch.Tensor,
                          cos_sin_cache: torch.Tensor, q_weight: torch.Tensor,
                          k_weight: torch.Tensor) -> None:
    assert head_dim > 0 and head_dim & (head_dim - 1) == 0, (
        f"head_dim must be a power of two, got {head_dim}")
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= head_dim, (
        f"rotary_dim must be even and in (0, head_dim], got {rotary_dim}")
    assert positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,), (
        "positions and slot_mapping must be [num_tokens]")
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == rotary_dim, (
        f"cos_sin_cache {tuple(cos_sin_cache.shape)} does not match rotary_dim {rotary_dim}")
    assert cos_sin_cache.stride(1) == 1 and cos_sin_cache.dtype == torch.float32
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        assert weight.shape == (head_dim,) and weight.stride(0) == 1, f"{name} must be [D]"
        # rms_norm's result dtype is weight * x's promotion: exact only when they agree.
        assert weight.dtype == dtype, f"{name} is {weight.dtype}, q/k are {dtype}"


@dataclass(frozen=True, eq=False)
class QKNormRope:
    """What qk_norm_rope_store does to a step's q, k and v, for a kernel that does it on the
    way (paged_attention's decode launches): the raw k/v of the step's tokens and the norm,
    rotary and slot inputs. That kernel's q is the raw query it is given."""

    key: torch.Tensor  # [T, Hkv, D] before k_norm; last dim contiguous
    value: torch.Tensor  # [T, Hkv, D], key's strides
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64; -1: the token's k/v are not stored
    cos_sin_cache: torch.Tensor  # [max_pos, rotary_dim] float32 (cos | sin halves)
    q_weight: torch.Tensor  # [D], the model dtype
    k_weight: torch.Tensor  # [D]
    eps: float
    rotary_dim: int

    def __post_init__(self) -> None:
        num_tokens, _, head_dim = self.key.shape
        assert self.value.shape == self.key.shape and self.value.stride() == self.key.stride(), (
            f"value {tuple(self.value.shape)} must match key {tuple(self.key.shape)}, strides too")
        assert self.key.stride(2) == 1, "key/value head_dim must be contiguous"
        assert self.value.dtype == self.key.dtype
        _check_norm_rope_args(num_tokens, self.key.dtype, head_dim, self.rotary_dim,
                              self.positions, self.slot_mapping, self.cos_sin_cache,
                              self.q_weight, self.k_weight)


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                       head_dim: int, rotary_dim: int,
                       out: torch.Tensor | None = None, *,
                       heads_per_program: int | None = None) -> torch.Tensor:
    """q_norm + k_norm + NeoX rotary on q and k + store of k/v into the paged cache, in one
    launch. Returns q `[T, num_heads, head_dim]` (normed, rotated, model dtype).

    qkv: `[T, (H + 2 * Hkv) * D]` (q | k | v), any row stride, last dim contiguous.
    positions, slot_mapping: int64 `[T]` (slot -1: k/v of that token are not stored).
    cos_sin_cache: float32 `[max_pos, rotary_dim]` (cos | sin halves, RotaryEmbedding's).
    q_weight, k_weight: `[D]` in qkv's dtype. k_cache, v_cache: `[num_blocks, block_size, Hkv,
    D]` with linear slots (kv_cache[0] / kv_cache[1]). `out`: optional `[T, H, D]` contiguous
    buffer in qkv's dtype; with it the call allocates nothing (CUDA-graph capturable).
    `heads_per_program`: heads a program handles (a power of two dividing H and Hkv); None:
    `choose_heads_per_program(T, H, Hkv)`'s choice. Each value is its own compile.
    """
    num_tokens, width = qkv.shape
    assert width == (num_heads + 2 * num_kv_heads) * head_dim, (
        f"qkv width {width} != (H + 2 * Hkv) * D = {(num_heads + 2 * num_kv_heads) * head_dim}")
    assert qkv.stride(-1) == 1, "qkv's last dim must be contiguous"
    _check_norm_rope_args(num_tokens, qkv.dtype, head_dim, rotary_dim, positions, slot_mapping,
                          cos_sin_cache, q_weight, k_weight)
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
    heads = (choose_heads_per_program(num_tokens, num_heads, num_kv_heads)
             if heads_per_program is None else heads_per_program)
    assert heads > 0 and heads & (heads - 1) == 0, (
        f"heads_per_program must be a power of two, got {heads}")
    assert num_heads % heads == 0 and num_kv_heads % heads == 0, (
        f"heads_per_program {heads} must divide H = {num_heads} and Hkv = {num_kv_heads}")
    pdl = pdl_enabled(qkv.device)
    _qk_norm_rope_store_kernel[(num_tokens, (num_heads + num_kv_heads) // heads)](
        qkv, positions, cos_sin_cache, q_weight, k_weight,
        k_cache, v_cache, slot_mapping, out,
        qkv.stride(0), out.stride(0), cos_sin_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS=heads,
        HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, PDL=pdl,
        num_warps=_num_warps(head_dim, heads), launch_pdl=pdl,
    )
    return out
