"""The attention layer: writes this step's K/V into the paged cache, then attends."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.attention_metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged attention over one layer's KV cache.

    `kv_cache` is [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V), set by
    the model runner once the cache exists. While it is None (the profiling pass that sizes
    the cache), each sequence attends causally over this step's own tokens only.
    `backend` is an attention backend from `models.backends.get_attention_backend`.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: Any) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """query [T, H, D], key/value [T, Hkv, D] -> [T, H, D]."""
        if self.kv_cache is None:
            return self.backend.forward_no_cache(query, key, value, meta, self.scale)
        self.backend.store_kv(key, value, self.kv_cache, meta.slot_mapping)
        return self.forward_cached(query, meta)

    def forward_cached(self, query: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over the cache alone: this step's K/V were stored by the caller."""
        return self.backend.forward(query, self.kv_cache, meta, self.scale)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, backend={getattr(self.backend, 'name', '?')}")
