"""Fusing the elementwise layers on GPUs: unfused, a decoder layer's norms, rotary and
SiLU-and-mul are ~50 tiny kernels whose launches set the decode step time. On CUDA these pure
functions run through torch.compile; on CPU they run as written (the reference path).
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
