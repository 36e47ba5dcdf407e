"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.fusion import fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_act(x: torch.Tensor, act: str) -> torch.Tensor:
    """[..., 2 * d] (gate | up) -> act(gate) * up: [..., d], as a kernel of its own (compiled
    on CUDA). `act` is a name gemv(act=...) also takes, so a linear layer can either fold the
    activation into its GEMV or call this first: only "silu_mul"."""
    if act != "silu_mul":
        raise ValueError(f"unknown gated activation {act!r} (known: 'silu_mul')")
    return fused(silu_and_mul, x)(x)


class SiluAndMul(nn.Module):
    """[..., 2 * d] (gate | up) -> silu(gate) * up: [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_act(x, "silu_mul")
