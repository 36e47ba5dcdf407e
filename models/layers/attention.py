"""The attention layer: attends over the paged KV cache (this step's K/V already stored)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.attention_metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged attention over one layer's `kv_cache` [2, num_blocks, block_size, Hkv, D], which
    the model runner sets; until then (the profiling pass) each sequence attends over this
    step's own tokens. `causal=False` (diffusion LLMs): every query token of a row attends to
    all of that row's context, fixed when the model is built."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 backend: Any, causal: bool = True) -> None:
        super().__init__()
        if not causal and not getattr(backend, "supports_non_causal", False):
            raise ValueError(
                f"attention_backend={getattr(backend, 'name', '?')!r} does not support the "
                f"non-causal attention of diffusion models; use 'triton' or 'torch'")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.causal = causal
        self.kv_cache: torch.Tensor | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D]. This step's K/V are already in the cache; key/value
        [T, Hkv, D] are given only while there is none."""
        if self.kv_cache is None:
            return self.backend.forward_no_cache(query, key, value, meta, self.scale,
                                                 causal=self.causal)
        return self.backend.forward(query, self.kv_cache, meta, self.scale, causal=self.causal)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, "
                f"backend={getattr(self.backend, 'name', '?')}")
