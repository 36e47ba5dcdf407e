"""Tensor-parallel helpers.

The tensor-parallel group is the default torch.distributed process group: one process per
rank, NCCL on GPUs and gloo on CPU. Without an initialized group this process is rank 0 of 1
and every collective is the identity.

Checkpoint tensors reach the layers' weight loaders either as tensors or as safetensors
slices (`safe_open(...).get_slice(name)`), so that a rank reads only its own rows or columns;
`weight_shape` / `narrow_weight` / `full_weight` hide the difference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# A torch.Tensor or a safetensors PySafeSlice (lazy: indexing it reads from disk).
WeightSource = Any


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_tp_rank() -> int:
    return dist.get_rank() if _initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def divide(numerator: int, denominator: int, what: str = "value") -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor-parallel "
                         f"size ({denominator})")
    return numerator // denominator


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; returns it."""
    if get_tp_size() > 1:
        dist.all_reduce(x)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `x` along the last dim (rank order); every rank gets it."""
    size = get_tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def tp_gather_last_dim(x: torch.Tensor, dst: int = 0) -> torch.Tensor | None:
    """Like `tp_all_gather_last_dim`, but only rank `dst` receives the result (others: None)."""
    size = get_tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)] if get_tp_rank() == dst else None
    dist.gather(x, parts, dst=dst)
    return torch.cat(parts, dim=-1) if parts is not None else None


def weight_shape(loaded: WeightSource) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow_weight(loaded: WeightSource, dim: int, start: int, length: int) -> torch.Tensor:
    """`loaded[..., start:start+length, ...]` along `dim`, read lazily from a slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = [slice(None)] * len(weight_shape(loaded))
    index[dim] = slice(start, start + length)
    return loaded[tuple(index)]


def full_weight(loaded: WeightSource) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def check_shape(param: torch.Tensor, expected: tuple[int, ...], loaded: WeightSource,
                what: str) -> None:
    """Raise a readable error when a checkpoint tensor does not fit its parameter."""
    got = weight_shape(loaded)
    if got != tuple(expected):
        raise ValueError(f"checkpoint tensor for {what} has shape {list(got)}, expected "
                         f"{list(expected)} (parameter shard {list(param.shape)})")
