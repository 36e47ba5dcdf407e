"""Rotary position embedding, NeoX style (the two halves of each head are rotated pairs)."""

from __future__ import annotations

import torch
from torch import nn

from models.layers.fusion import fused


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_position are precomputed once, in float32.

    Build the model under the target device/default dtype rather than calling
    `model.to(dtype)`, which would also cast this float32 cache.
    """

    def __init__(self, head_size: int, max_position: int, base: float,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        if self.rotary_dim % 2 != 0 or self.rotary_dim > head_size:
            raise ValueError(f"rotary_dim must be even and <= head_size, got {self.rotary_dim}")
        # Same float32 formula as transformers, so the angles agree exactly.
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        inv_freq = 1.0 / (base ** exponent)  # [rotary_dim / 2]
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]  # [max_position, rotary_dim / 2]
        cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_pos, rotary_dim]
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, H, D]; key [T, Hkv, D] -> rotated (query, key)."""
        return fused(apply_rotary, query)(positions, query, key, self.cos_sin_cache,
                                          self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            rotary_dim: int) -> torch.Tensor:
    # x: [T, heads, head_size]; cos/sin: [T, 1, rotary_dim / 2] (float32)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    x1, x2 = rot.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def apply_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 cos_sin_cache: torch.Tensor, rotary_dim: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    cos_sin = cos_sin_cache[positions].unsqueeze(1)  # [T, 1, rotary_dim]
    cos, sin = cos_sin.float().chunk(2, dim=-1)
    return _rotate(query, cos, sin, rotary_dim), _rotate(key, cos, sin, rotary_dim)
