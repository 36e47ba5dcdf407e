"""Triton kernel that writes a step's keys and values into the paged KV cache: token t goes
to slot `slot_mapping[t] = block * block_size + offset`; slot -1 means "do not store"."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    # A -1 slot masks the whole row instead of branching: it leaves no head to store.
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM)
    cache_off = slot * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `key`/`value` `[T, Hkv, D]` (head_dim contiguous) into the linear-slot caches
    `[num_blocks, block_size, Hkv, D]` at `slot_mapping [T]`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, f"key {tuple(key.shape)} != value {tuple(value.shape)}"
    assert slot_mapping.shape == (num_tokens,), "slot_mapping must be [num_tokens]"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), (
        f"cache {tuple(k_cache.shape)} does not match key heads/dim {(num_kv_heads, head_dim)}")
    assert head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}"
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    for cache in (k_cache, v_cache):
        assert cache.stride(3) == 1 and cache.stride(2) == head_dim, "cache heads not packed"
        assert cache.stride(0) == cache.shape[1] * cache.stride(1), "cache slots not linear"
    assert k_cache.stride() == v_cache.stride()
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 2,
    )
