"""Qwen3 dense decoder (tensor-parallel aware).

Differences from Llama/Qwen2 that matter here: q_norm and k_norm (RMSNorm over head_dim,
per head, applied BEFORE rotary), no q/k/v biases, an explicit head_dim, and optionally tied
input/output embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models.attention_metadata import AttentionMetadata
from models.config import Qwen3Config
from models.layers.activation import SiluAndMul
from models.layers.attention import Attention
from models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from models.layers.layernorm import RMSNorm
from models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    batch1_gemv_applies,
    fused_gemv,
)
from models.layers.rotary import RotaryEmbedding
from models.parallel import PushedPartial, get_tp_size

# Qwen3-8B shape, 512 + 512 single-request decode on H200s, fused / two launches (session
# 16, `bench offline --single`): TP=1 230.8 / 227.5 and 223.8 / 222.1 tok/s (two machines),
# TP=2 406.6 and 407.1 / 407.2, TP=4 547.2 and 548.1 / 553.7 (session 17: 547.8 / 552.3;
# 549.9 with a qkv GEMV that lets the attention launch only as its programs exit). Session
# 18 tried a fold that loads its first key tile before the PDL wait and needs no barrier:
# TP=4 545.0 against 551.8 with two launches, TP=1 229.7 against this fold's 230.8. Above
# one rank each attention program's longer chain (norm, store) costs as much as the launch
# it saves, or more.
FUSED_DECODE_ATTENTION_MAX_TP = 1


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config, rotary_emb: RotaryEmbedding, backend: Any) -> None:
        super().__init__()
        head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim,
                                          config.num_attention_heads,
                                          config.num_key_value_heads,
                                          bias=config.attention_bias)
        self.num_heads = self.qkv_proj.num_heads  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads  # per rank
        self.head_dim = head_dim
        # Partial sums: the next norm reduces them (fused with its add where it can).
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim,
                                        config.hidden_size, bias=False, reduce_results=False)
        self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_emb  # shared by all layers
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim,
                              scale=head_dim**-0.5, backend=backend)
        # A GPU backend offers one launch for both norms, rotary and the cache store (at
        # decode batch sizes five separate launches cost more than their bytes); the torch
        # backend offers none and keeps the reference path.
        self._fused_store = backend.qk_norm_rope_store
        # At decode the attention launch itself can do that work (one launch fewer a layer),
        # where it measured faster: on one rank.
        self._fused_decode = (backend.decode_attention_qk_norm_rope
                              if get_tp_size() <= FUSED_DECODE_ATTENTION_MAX_TP else None)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor | PushedPartial:
        return self.attend(positions, self.qkv_proj(hidden_states), meta)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor | PushedPartial:
        """qkv [T, (H + 2 * Hkv) * D] (this rank's heads) -> o_proj's output [T, hidden]."""
        kv_cache = self.attn.kv_cache
        if self._fused_decode is not None and kv_cache is not None and meta.decode_only:
            out = self._fused_decode(
                qkv, positions, self.rotary_emb.cos_sin_cache, self.q_norm.weight,
                self.k_norm.weight, self.q_norm.eps, kv_cache, meta, self.num_heads,
                self.num_kv_heads, self.head_dim, self.rotary_emb.rotary_dim,
                self.attn.scale)  # [T, H, D]
            return self.o_proj(out.flatten(1))
        if self._fused_store is not None and kv_cache is not None:
            q = self._fused_store(
                qkv, positions, self.rotary_emb.cos_sin_cache, self.q_norm.weight,
                self.k_norm.weight, self.q_norm.eps, kv_cache[0], kv_cache[1],
                meta.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim,
                self.rotary_emb.rotary_dim)  # [T, H, D]
            return self.o_proj(self.attn.forward_cached(q, meta).flatten(1))
        q, k, v = qkv.split([self.qkv_proj.q_size, self.qkv_proj.kv_size,
                             self.qkv_proj.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))  # [T, H, D]
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, meta)  # [T, H, D]
        return self.o_proj(out.flatten(1))  # [T, hidden]


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=False, reduce_results=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor | PushedPartial:
        weight = self.gate_up_proj.weight
        if batch1_gemv_applies(x, weight, silu_mul=True):
            # One launch for the GEMV and SiLU-and-mul (at batch 1 the activation kernel
            # costs about as much as its launch).
            return self.down_proj(fused_gemv(x, weight, silu_mul=True)[0])
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, rotary_emb: RotaryEmbedding, backend: Any) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb, backend)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor | PushedPartial,
                residual: torch.Tensor | None, meta: AttentionMetadata
                ) -> tuple[torch.Tensor | PushedPartial, torch.Tensor]:
        # The residual add is fused into the next norm, and so is the tensor-parallel sum
        # of the attention and MLP outputs: returns (mlp partial output, residual). At
        # batch 1 in a group that pushes (models/parallel.py, push_partials_enabled) the
        # partials are pushed: o_proj's and down_proj's GEMVs write them into the
        # all-reduce kernel's buffers, which the next norm reads.
        if self._norms_into_gemvs(hidden_states):
            return self._forward_batch1(positions, hidden_states, residual, meta)
        # The first layer's input is the embedding's partial sum (residual None).
        hidden_states, residual = self.input_layernorm(hidden_states, residual, reduce=True)
        hidden_states = self.self_attn(positions, hidden_states, meta)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual,
                                                                reduce=True)
        return self.mlp(hidden_states), residual

    def _norms_into_gemvs(self, x: torch.Tensor | PushedPartial) -> bool:
        """Batch-1 decode on one rank (with more, a norm's input is a partial sum that the
        all-reduce kernel normalizes), where the fused GEMV serves both projections."""
        if get_tp_size() > 1:
            return False
        qkv = self.self_attn.qkv_proj  # gate_up_proj never has a bias; qkv may
        return (qkv.bias is None and batch1_gemv_applies(x, qkv.weight)
                and batch1_gemv_applies(x, self.mlp.gate_up_proj.weight, silu_mul=True))

    def _forward_batch1(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                        residual: torch.Tensor | None,
                        meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """forward at batch 1: each norm (and its residual add) runs inside the GEMV that
        reads its output, and SiLU-and-mul inside the gate_up GEMV: 3 launches fewer a
        layer, which at batch 1 is most of what those kernels cost."""
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv, residual = fused_gemv(hidden_states, attn.qkv_proj.weight,
                                   norm_weight=norm1.weight, eps=norm1.eps, residual=residual)
        hidden_states = attn.attend(positions, qkv, meta)
        act, residual = fused_gemv(hidden_states, mlp.gate_up_proj.weight,
                                   norm_weight=norm2.weight, eps=norm2.eps, residual=residual,
                                   silu_mul=True)
        return mlp.down_proj(act), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config, backend: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                     config.rope_theta)
        self.layers = nn.ModuleList(
            [Qwen3DecoderLayer(config, rotary_emb, backend)
             for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # A partial sum at TP > 1, like each layer's output: layer 0's norm kernel sums it.
        hidden_states = self.embed_tokens(input_ids, reduce=False)  # [T, hidden]
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, meta)
        hidden_states, _ = self.norm(hidden_states, residual, reduce=True)
        return hidden_states


class Qwen3ForCausalLM(nn.Module):
    # Checkpoint module name -> (fused module name, shard id), for models.loader.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Qwen3Config, backend: Any) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            # Same vocab split as the embedding, so the shard is shared as is.
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """hidden_states [N, hidden] -> logits over the full vocabulary [N, vocab] in the
        model dtype (gathered across tensor-parallel ranks; every rank gets them), or with
        gather=False over this rank's vocab range only (`lm_head.vocab_start` on). Not
        upcast here: the sampler's kernel reads them as they are, and its other paths make
        the float32 copy they need (at batch 256 the copy was a 100 us kernel a step)."""
        return self.lm_head(hidden_states, gather)

    def fused_decode_rotary_dim(self) -> int | None:
        """The rotary_dim of the decode attention launches that norm and rotate q/k
        themselves (what the backend's warm_up compiles), or None where the layers do not
        take them (the backend has none, or TP > FUSED_DECODE_ATTENTION_MAX_TP)."""
        attn = self.model.layers[0].self_attn
        return attn.rotary_emb.rotary_dim if attn._fused_decode is not None else None

    def attention_layers(self) -> list[Attention]:
        """Every Attention module in layer order; the runner sets their `kv_cache`."""
        return [layer.self_attn.attn for layer in self.model.layers]
