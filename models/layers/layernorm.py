"""RMSNorm with an optional fused residual add (vLLM convention)."""

from __future__ import annotations

import torch
from torch import nn

from models.layers.fusion import fused
from models.parallel import tp_all_reduce


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32 (bf16 squares overflow/underflow); the scale is applied in the
    # input dtype, in the same order as transformers, so results match it bit for bit.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + residual
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None,
        reduce: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden]. With `reduce` x is a TP partial sum, reduced first (in place);
        with `residual` or `reduce`, returns (norm(s), s) for s = x [+ residual]."""
        if residual is None and not reduce:
            return fused(rms_norm, x)(x, self.weight, self.eps)
        if reduce:
            x = tp_all_reduce(x)
        if residual is None:
            return fused(rms_norm, x)(x, self.weight, self.eps), x
        return fused(add_rms_norm, x)(x, residual, self.weight, self.eps)
