"""Mixture-of-experts layer (Qwen3-MoE): top-k routing and the experts' gated MLPs.

Tensor parallelism shards the experts whole: rank r holds experts [r * E / tp, (r + 1) * E / tp).
Every rank routes every token, so the ranks' outputs are partial sums the caller all-reduces.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.parallel import WeightSource, check_shape, full_weight, get_tp_rank, get_tp_size

# Checkpoints keep one tensor per expert and projection: "...experts.{e}.{proj}.weight".
_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# (x [T, H], topk_weights [T, k] float32, topk_ids [T, k]) -> [T, H]
ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (router_logits [T, E], top_k, renormalize) -> (topk_weights, topk_ids)
SelectFn = Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64): float32
    softmax, top k, rescaled to sum to 1 with `renormalize` (norm_topk_prob)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


class FusedMoE(nn.Module):
    """Experts of one MoE layer: w13_weight [E_local, 2 * I, H] (gate | up rows), w2_weight
    [E_local, H, I]; forward returns this rank's partial sum. use_triton: the kernels of
    models/kernels/fused_moe.py, else torch (a loop over the local experts)."""

    # Hub projection name -> (parameter, shard kind); see `checkpoint_target`.
    PROJECTIONS: dict[str, tuple[str, str]] = {
        "gate_proj": ("w13_weight", "gate"),
        "up_proj": ("w13_weight", "up"),
        "down_proj": ("w2_weight", "down"),
    }

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, use_triton: bool,
                 tp_rank: int | None = None, tp_size: int | None = None) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank() if tp_rank is None else tp_rank
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        if num_experts % self.tp_size != 0:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by "
                             f"tensor_parallel_size ({self.tp_size}): experts are sharded "
                             f"whole over the ranks")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank ({self.tp_rank}) must be in [0, {self.tp_size})")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be in [1, num_experts={num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.num_local_experts = num_experts // self.tp_size
        self.first_expert = self.tp_rank * self.num_local_experts
        self.w13_weight = nn.Parameter(
            torch.empty(self.num_local_experts, 2 * intermediate_size, hidden_size),
            requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight = nn.Parameter(
            torch.empty(self.num_local_experts, hidden_size, intermediate_size),
            requires_grad=False)
        self.w2_weight.weight_loader = self.weight_loader
        # One implementation per layer, chosen here: forward never branches on the device.
        self._select: SelectFn = select_experts
        self._experts: ExpertsFn = self._torch_experts
        if use_triton:
            from models.kernels.fused_moe import fused_moe, fused_topk  # triton is GPU-only

            self._fused_moe = fused_moe
            self._select = fused_topk
            self._experts = self._triton_experts

    @classmethod
    def checkpoint_target(cls, name: str) -> tuple[str, tuple[int, str]] | None:
        """Hub tensor name -> (parameter name, shard_id), or None for a non-expert tensor:
        "model.layers.0.mlp.experts.3.up_proj.weight" ->
        ("model.layers.0.mlp.experts.w13_weight", (3, "up"))."""
        found = _EXPERT_TENSOR.search(name)
        if found is None:
            return None
        param, kind = cls.PROJECTIONS[found.group(2)]
        return f"{name[:found.start()]}.experts.{param}", (int(found.group(1)), kind)

    def weight_loader(self, param: nn.Parameter, loaded_weight: WeightSource,
                      shard_id: tuple[int, str]) -> None:
        """Copy expert `shard_id[0]`'s gate, up or down projection (hub layout [out, in]) into
        its slot; experts of other ranks are skipped without reading them."""
        if (not isinstance(shard_id, tuple) or len(shard_id) != 2
                or shard_id[1] not in ("gate", "up", "down")):
            raise ValueError(f"FusedMoE shard_id must be (expert id, 'gate' | 'up' | 'down'), "
                             f"got {shard_id!r}")
        expert, kind = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert id {expert} out of range [0, {self.num_experts})")
        target = self.w2_weight if kind == "down" else self.w13_weight
        if param is not target:
            raise ValueError(f"FusedMoE shard {kind!r} belongs to "
                             f"{'w2_weight' if kind == 'down' else 'w13_weight'}")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        inter = self.intermediate_size
        if kind == "down":
            dest = param.data[local]
        else:
            dest = param.data[local].narrow(0, 0 if kind == "gate" else inter, inter)
        check_shape(dest, tuple(dest.shape), loaded_weight, f"expert {expert} {kind}_proj")
        dest.copy_(full_weight(loaded_weight))

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        # hidden_states [T, H], router_logits [T, E] -> [T, H] (this rank's partial sum)
        topk_weights, topk_ids = self._select(router_logits, self.top_k, self.renormalize)
        return self._experts(hidden_states, topk_weights, topk_ids)

    def _torch_experts(self, x: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
        """Per local expert: gather its tokens, run its MLP, scale, index_add. Same order and
        casts as transformers' Qwen3MoeExperts, so float32 results match it bit for bit."""
        out = torch.zeros_like(x)
        weights = topk_weights.to(x.dtype)  # the reference scales in the activation dtype
        choices = topk_ids.t()  # [k, T]: an expert's tokens in choice-major order
        inter = self.intermediate_size
        for local in range(self.num_local_experts):
            choice, tokens = torch.where(choices == self.first_expert + local)
            if tokens.numel() == 0:
                continue
            gate_up = F.linear(x[tokens], self.w13_weight[local])  # [n, 2I]
            h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            y = F.linear(h, self.w2_weight[local]) * weights[tokens, choice, None]  # [n, H]
            out.index_add_(0, tokens, y)
        return out

    def _triton_experts(self, x: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
        return self._fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                               first_expert=self.first_expert)
