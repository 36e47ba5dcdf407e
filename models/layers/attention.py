"""The attention layer: attends over the paged KV cache (this step's K/V already stored)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.attention_metadata import AttentionMetadata, HeadSparsity
from models.layers.head_sparse import attend_kept_keys, choose_keys


class Attention(nn.Module):
    """Paged attention over one layer's `kv_cache` [2, num_blocks, block_size, Hkv, D], which
    the model runner sets; until then (the profiling pass) each sequence attends over this
    step's own tokens. `causal=False` (diffusion LLMs): every query token of a row attends to
    all of that row's context, fixed when the model is built. A forward with
    `meta.head_sparsity` (diffusion) attends its trailing rows to their kept keys in plain
    torch (models/layers/head_sparse.py), the rest through the backend."""

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
        self.layer_idx = 0  # its index among the model's layers, set by the model

    def forward(self, query: torch.Tensor, key: torch.Tensor | None,
                value: torch.Tensor | None, meta: AttentionMetadata) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D]. This step's K/V are already in the cache; key/value
        [T, Hkv, D] are given only while there is none."""
        if self.kv_cache is None:
            return self.backend.forward_no_cache(query, key, value, meta, self.scale,
                                                 causal=self.causal)
        if meta.head_sparsity is not None:
            return self._forward_head_sparse(query, meta.head_sparsity)
        return self.backend.forward(query, self.kv_cache, meta, self.scale, causal=self.causal)

    def _forward_head_sparse(self, query: torch.Tensor, sparsity: HeadSparsity
                             ) -> torch.Tensor:
        """query [T, H, D] -> [T, H, D]: the leading rows through the backend (the choosing
        ones then pick their keys), the trailing ones over their kept keys only."""
        out = torch.empty_like(query)
        num_dense = sparsity.num_dense_tokens
        if num_dense:
            out[:num_dense] = self.backend.forward(query[:num_dense], self.kv_cache,
                                                   sparsity.dense, self.scale,
                                                   causal=self.causal)
        for choice in sparsity.choices:
            choose_keys(query, self.kv_cache, choice, self.layer_idx, self.scale)
        if num_dense < query.shape[0]:
            out[num_dense:] = attend_kept_keys(query, self.kv_cache, sparsity,
                                               self.layer_idx, self.scale)
        return out
