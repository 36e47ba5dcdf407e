"""LLaDA (GSAI-ML/LLaDA-8B-*, `LLaDAModelLM`): a masked-diffusion LLM with Llama's decoder and
bidirectional attention. Its checkpoints keep OLMo's module names, which `weights_mapper` turns
into Llama's: under `model.transformer.`, `wte` (embedding), `blocks.{i}.` {`q_proj`, `k_proj`,
`v_proj`, `attn_out`, `attn_norm`, `ff_norm`, `ff_proj` (the SiLU gate), `up_proj`, `ff_out`
(down)}, `ln_f` (final norm) and `ff_out` (output layer, absent when weight_tying).

Its logits at position i score the token AT i (the one a mask there stands for), not the next.
"""

from __future__ import annotations

from models.llama import LlamaForCausalLM
from models.loader import WeightsMapper


class LLaDAModelLM(LlamaForCausalLM):
    """Llama's layers; ModelConfig makes its attention non-causal."""

    predicts_next_token = False
    weights_mapper = WeightsMapper(
        orig_to_new_prefix={
            "model.transformer.blocks.": "model.layers.",
            "model.transformer.wte.": "model.embed_tokens.",
            "model.transformer.ln_f.": "model.norm.",
            "model.transformer.ff_out.": "lm_head.",
        },
        orig_to_new_substr={
            ".q_proj.": ".self_attn.q_proj.",
            ".k_proj.": ".self_attn.k_proj.",
            ".v_proj.": ".self_attn.v_proj.",
            ".attn_out.": ".self_attn.o_proj.",
            ".ff_proj.": ".mlp.gate_proj.",
            ".up_proj.": ".mlp.up_proj.",
            ".ff_out.": ".mlp.down_proj.",
            ".attn_norm.": ".input_layernorm.",
            ".ff_norm.": ".post_attention_layernorm.",
        },
    )
