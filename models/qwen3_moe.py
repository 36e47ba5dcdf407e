"""Qwen3-MoE: Qwen3 whose MLP is, in most layers (ModelConfig.is_moe_layer), a mixture of
experts. The router is replicated; the experts are sharded and each rank returns its partial
sum, which the next RMSNorm reduces."""

from __future__ import annotations

import torch
from torch import nn

from models.config import ModelConfig
from models.layers.fused_moe import FusedMoE
from models.layers.layernorm import RMSNorm
from models.layers.linear import ReplicatedLinear
from models.llama import LlamaMLP
from models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        # The grouped-GEMM Triton kernel where the model is built on a GPU.
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok,
                                config.hidden_size, config.moe_intermediate_size,
                                renormalize=config.norm_topk_prob,
                                use_triton=torch.get_default_device().type == "cuda")

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] partial sums -> (this rank's partial output [T, hidden], residual)."""
        x, residual = norm(x, residual, reduce=True)
        router_logits = self.gate(x)  # [T, num_experts]
        return self.experts(x, router_logits), residual


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        if config.is_moe_layer(layer_idx):
            return Qwen3MoeSparseMoeBlock(config)
        return LlamaMLP(config.hidden_size, config.intermediate_size)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
