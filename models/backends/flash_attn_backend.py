"""Attention backend on flash-attn 2 (`pip install flash-attn`), imported lazily.

flash-attn's paged kernels read our cache layout as is but need block sizes that are multiples
of 256; their causal masks align bottom-right, as our queries are each row's last positions.
With causal=False every query attends to all of its row's keys (diffusion LLMs).
Decode-only batches use `flash_attn_with_kvcache` (CUDA-graph capturable), mixed batches
`flash_attn_varlen_func`.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from models.attention_metadata import AttentionMetadata

FLASH_ATTN_BLOCK_MULTIPLE = 256


def _import_flash_attn() -> ModuleType:
    try:
        import flash_attn
    except ImportError as exc:
        raise ImportError(
            "attention backend 'flash-attn' needs the flash-attn package "
            "(pip install flash-attn --no-build-isolation); use --attention-backend triton "
            "or torch instead") from exc
    return flash_attn


class FlashAttnBackend:
    name = "flash-attn"
    supports_non_causal = True

    def __init__(self) -> None:
        self._fa = _import_flash_attn()
        # The triton backend's store kernel (same cache layout); imported lazily like flash_attn.
        from models.kernels.store_kv import store_kv

        self._store_kv = store_kv

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """key/value [T, Hkv, D] -> kv_cache at slot_mapping [T] (slot -1: skipped)."""
        self._store_kv(key, value, kv_cache[0], kv_cache[1], slot_mapping)

    def forward(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, causal: bool = True) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D] over each row's cached context."""
        block_size = kv_cache.shape[2]
        if block_size % FLASH_ATTN_BLOCK_MULTIPLE:
            raise ValueError(f"attention backend 'flash-attn' needs kv_block_size to be a "
                             f"multiple of {FLASH_ATTN_BLOCK_MULTIPLE}, got {block_size}; "
                             f"use --attention-backend triton for other block sizes")
        k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, Hkv, D]
        if meta.decode_only:
            out = self._fa.flash_attn_with_kvcache(
                query.unsqueeze(1),  # [B, 1, H, D]
                k_cache, v_cache,
                cache_seqlens=meta.seq_lens,  # [B] int32, includes this step's token
                block_table=meta.block_tables,
                softmax_scale=scale, causal=causal)
            return out.squeeze(1)  # [B, H, D]
        # cu_seqlens_k on the device: no host sync; with block_table it only gives lengths.
        cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))
        return self._fa.flash_attn_varlen_func(
            query, k_cache, v_cache,
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale, causal=causal, block_table=meta.block_tables)

    def warm_up(self, kv_cache: torch.Tensor, num_heads: int, causal: bool = True) -> None:
        """Nothing to compile ahead of serving."""

    def forward_no_cache(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         meta: AttentionMetadata, scale: float,
                         causal: bool = True) -> torch.Tensor:
        """Attention over each row's own tokens (profiling pass, no cache yet)."""
        return self._fa.flash_attn_varlen_func(
            query, key, value,
            cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_q,
            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_query_len,
            softmax_scale=scale, causal=causal)
