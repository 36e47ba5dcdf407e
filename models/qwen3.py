"""Qwen3: Llama's decoder with an RMSNorm over each q and k head, applied before rotary."""

from __future__ import annotations

from typing import Any

import torch

from models.config import ModelConfig
from models.layers.layernorm import RMSNorm
from models.layers.rotary import RotaryEmbedding
from models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, backend: Any) -> None:
        super().__init__(config, rotary_emb, backend)
        self.q_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, eps=config.rms_norm_eps)

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.q_norm.weight, self.k_norm.weight


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
