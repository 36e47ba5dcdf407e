"""Llama decoder, tensor-parallel aware: the base of every family nanoserve serves (Mistral
as is, Qwen2 with q/k/v biases, Qwen3 and Qwen3-MoE in their own files).

Each block (attention, MLP) takes the previous block's output (a partial sum over the TP
ranks), the residual and its input norm, and returns its own partial output and the new
residual, so it can reduce, add, normalise and project in one call (models/layers/decode_ops.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.attention_metadata import AttentionMetadata
from models.config import ModelConfig
from models.layers.attention import Attention
from models.layers.decode_ops import norm_linear, rope_store
from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layers.layernorm import RMSNorm
from models.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from models.layers.rotary import RotaryEmbedding, get_rope
from models.parallel import tp_all_reduce


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary_emb: RotaryEmbedding, backend: Any) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim,
                                          config.num_attention_heads,
                                          config.num_key_value_heads,
                                          bias=config.attention_bias)
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim,
                                        config.hidden_size, bias=config.o_proj_bias,
                                        reduce_results=False)
        self.rotary_emb = rotary_emb  # shared by all layers
        self.qk_norm_eps = config.rms_norm_eps  # of Qwen3's q/k norm, where there is one
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim,
                              scale=head_dim**-0.5, backend=backend, causal=config.causal)

    def qk_norm_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Per-head RMSNorm weights for q and k, applied before rotary (Qwen3); none here."""
        return None, None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                norm: RMSNorm, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] partial sums -> (this rank's partial o_proj output [T, hidden],
        residual)."""
        qkv, residual = norm_linear(tp_all_reduce(x), residual, norm.weight, norm.eps,
                                    self.qkv_proj.weight, self.qkv_proj.bias)
        q_norm, k_norm = self.qk_norm_weights()
        # k and v come back only when there is no cache yet (the profiling pass).
        q, k, v = rope_store(qkv, positions, self.rotary_emb.cos_sin_cache,
                             self.rotary_emb.rotary_dim, q_norm, k_norm, self.qk_norm_eps,
                             self.attn.kv_cache, meta.slot_mapping, self.num_heads,
                             self.num_kv_heads, self.head_dim, self.attn.backend.store_kv)
        out = self.attn(q, k, v, meta)  # [T, H, D]
        return self.o_proj(out.flatten(1)), residual


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False,
                                           reduce_results=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] partial sums -> (this rank's partial output [T, hidden], residual)."""
        act, residual = norm_linear(tp_all_reduce(x), residual, norm.weight, norm.eps,
                                    self.gate_up_proj.weight, silu_mul=True)
        return self.down_proj(act), residual


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 backend: Any) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, rotary_emb, backend)
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states: the previous layer's partial MLP output (the embedding's for layer
        0, with residual None) -> (this layer's partial MLP output, residual)."""
        hidden_states, residual = self.self_attn(positions, hidden_states, residual,
                                                 self.input_layernorm, meta)
        return self.mlp(hidden_states, residual, self.post_attention_layernorm)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layer_cls: type[LlamaDecoderLayer],
                 backend: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = get_rope(config.head_dim, config.max_position_embeddings,
                              config.rope_theta, config.rope_scaling,
                              original_max_position=config.max_position_embeddings)
        self.layers = nn.ModuleList([layer_cls(config, i, rotary_emb, backend)
                                     for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # A partial sum at TP > 1, like each layer's output: layer 0's norm reduces it.
        hidden_states = self.embed_tokens(input_ids, reduce=False)  # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
        hidden_states, _ = self.norm(hidden_states, residual, reduce=True)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # Logits at position i score the token at i + 1 (a diffusion family may score i).
    predicts_next_token = True
    # Checkpoint module name -> (fused module name, shard id), for models.loader.
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, backend: Any) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.layer_cls, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        for i, attn in enumerate(self.attention_layers()):
            attn.layer_idx = i  # its slice of per-layer state (head-sparse attention)
        if config.tie_word_embeddings:
            # Same vocab split as the embedding, so the shard is shared as is.
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """hidden_states [N, hidden] -> logits [N, vocab] in the model dtype (gathered over
        the ranks), or with gather=False over this rank's vocab range only."""
        return self.lm_head(hidden_states, gather)

    def attention_layers(self) -> list[Attention]:
        """Every Attention module in layer order; the runner sets their `kv_cache`."""
        return [layer.self_attn.attn for layer in self.model.layers]


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's architecture (sliding-window checkpoints are refused by the config)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 is Llama's architecture with q/k/v biases (ModelConfig sets attention_bias)."""
