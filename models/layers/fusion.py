"""Fusing the elementwise layers on GPUs.

Unfused, one decoder layer's norms, rotary embedding and SiLU-and-mul are ~50 tiny
kernels: at decode batch sizes their launches, not the weights, set the step time, even
replayed from a CUDA graph. On CUDA tensors these pure functions run through
torch.compile (one fused Triton kernel each); on CPU they run as written, so the CPU
reference path stays exactly the code you read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=True, fullgraph=True)


def fused(fn: Callable, x: torch.Tensor) -> Callable:
    return _compiled(fn) if x.is_cuda else fn
