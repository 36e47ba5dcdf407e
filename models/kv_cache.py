"""The paged KV cache of a model: its size per block and its allocation."""

from __future__ import annotations

import torch
from torch import nn


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block over the model's layers (this rank's KV heads)."""
    layers = model.attention_layers()
    return (2 * len(layers) * block_size * layers[0].num_kv_heads * layers[0].head_dim
            * dtype.itemsize)


def allocate_kv_cache(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """A zeroed cache, each layer's slice handed to its attention layer."""
    layers = model.attention_layers()
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    cache = torch.zeros(len(layers), 2, num_blocks, block_size, layers[0].num_kv_heads,
                        layers[0].head_dim, dtype=dtype, device=device)
    for layer, attn in enumerate(layers):
        attn.kv_cache = cache[layer]
    return cache
