"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.fusion import fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """[..., 2 * d] (gate | up) -> silu(gate) * up: [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused(silu_and_mul, x)(x)
