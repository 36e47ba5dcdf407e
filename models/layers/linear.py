"""Tensor-parallel linear layers (vLLM naming).

Column-parallel layers split the output features across ranks (no communication);
row-parallel layers split the input features and sum the partial outputs (all-reduce).
Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)` that takes the
FULL checkpoint tensor (or a lazy safetensors slice of it) and copies this rank's shard.
"""

from __future__ import annotations

import torch
from torch import nn

from models.layers.decode_ops import linear
from models.parallel import (
    WeightSource,
    check_shape,
    divide,
    full_weight,
    get_tp_rank,
    get_tp_size,
    narrow_weight,
    tp_all_reduce,
)


class LinearBase(nn.Module):
    """Holds this rank's shard: weight [output_per_rank, input_per_rank] (+ bias)."""

    def __init__(self, input_per_rank: int, output_per_rank: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.weight = nn.Parameter(torch.empty(output_per_rank, input_per_rank),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource,
                      shard_id: str | int | None = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (an MoE router: every rank routes every token)."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource,
                      shard_id: str | int | None = None) -> None:
        check_shape(param, tuple(param.shape), loaded_weight, type(self).__name__)
        param.data.copy_(full_weight(loaded_weight))


class MergedColumnParallelLinear(LinearBase):
    """Column-parallel outputs (split by output features) fused into one matmul (gate_up_proj:
    shard ids 0, 1). Each rank holds [its slice of output 0 | its slice of output 1 | ...]."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        tp_size = get_tp_size()
        self.output_sizes = list(output_sizes)
        self.sizes_per_rank = [divide(s, tp_size, "output_size") for s in output_sizes]
        super().__init__(input_size, sum(self.sizes_per_rank), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource,
                      shard_id: str | int | None = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear shard_id must be an int in "
                             f"[0, {len(self.output_sizes)}), got {shard_id!r}")
        check_shape(param, (self.output_sizes[shard_id], *param.shape[1:]), loaded_weight,
                    f"MergedColumnParallelLinear shard {shard_id}")
        rows = self.sizes_per_rank[shard_id]
        offset = sum(self.sizes_per_rank[:shard_id])
        param.data.narrow(0, offset, rows).copy_(
            narrow_weight(loaded_weight, 0, self.tp_rank * rows, rows))


class QKVParallelLinear(LinearBase):
    """q, k and v projections fused; split by attention heads (shard ids "q", "k", "v"). With
    more ranks than KV heads, each KV head is replicated on tp_size / num_kv_heads ranks."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False) -> None:
        tp_size = get_tp_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= total_num_kv_heads:
            divide(tp_size, total_num_kv_heads, "tensor_parallel_size vs num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_replicas = tp_size // total_num_kv_heads
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_replicas = 1
        self.q_size = self.num_heads * head_size  # per rank
        self.kv_size = self.num_kv_heads * head_size  # per rank
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource,
                      shard_id: str | int | None = None) -> None:
        if shard_id == "q":
            total_rows, rows, offset = self.total_num_heads * self.head_size, self.q_size, 0
            start = self.tp_rank * rows
        elif shard_id in ("k", "v"):
            total_rows, rows = self.total_num_kv_heads * self.head_size, self.kv_size
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            start = (self.tp_rank // self.kv_replicas) * rows
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', "
                             f"got {shard_id!r}")
        check_shape(param, (total_rows, *param.shape[1:]), loaded_weight,
                    f"QKVParallelLinear shard {shard_id!r}")
        param.data.narrow(0, offset, rows).copy_(narrow_weight(loaded_weight, 0, start, rows))


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (input features) split; partial sums all-reduced, or with
    `reduce_results=False` left to the consumer (e.g. an RMSNorm with `reduce=True`)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 reduce_results: bool = True) -> None:
        self.reduce_results = reduce_results
        self.input_size = input_size
        self.input_per_rank = divide(input_size, get_tp_size(), "input_size")
        super().__init__(self.input_per_rank, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource,
                      shard_id: str | int | None = None) -> None:
        if param.dim() == 1:  # bias: replicated, added once (on rank 0) before the reduce
            check_shape(param, tuple(param.shape), loaded_weight, "RowParallelLinear bias")
            param.data.copy_(narrow_weight(loaded_weight, 0, 0, param.shape[0]))
            return
        check_shape(param, (param.shape[0], self.input_size), loaded_weight,
                    "RowParallelLinear")
        cols = self.input_per_rank
        param.data.copy_(narrow_weight(loaded_weight, 1, self.tp_rank * cols, cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, input_per_rank] -> [num_tokens, output_size]
        bias = self.bias if self.tp_rank == 0 else None
        out = linear(x, self.weight, bias)
        return tp_all_reduce(out) if self.reduce_results else out
