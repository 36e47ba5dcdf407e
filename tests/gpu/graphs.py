"""CUDA-graph capture for the GPU tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `fn` once on a side stream (Triton compiles, allocators warm up: neither may
    happen inside a capture), then capture one call of it. Returns the graph and what the
    captured call returned (its outputs: each replay rewrites them)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs
