"""Reference model shapes from DESIGN.md, for benchmarks with random (dummy) weights:
speed does not depend on the weights' values."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

_QWEN3_COMMON = dict(
    architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, head_dim=128,
    num_key_value_heads=8, rms_norm_eps=1e-6, rope_theta=1_000_000.0, hidden_act="silu",
    max_position_embeddings=40960, torch_dtype="bfloat16", bos_token_id=151643,
    eos_token_id=151645, attention_bias=False)

PRESETS: dict[str, dict] = {
    "qwen3-0.6b": dict(_QWEN3_COMMON, hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, intermediate_size=3072,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3_COMMON, hidden_size=4096, num_hidden_layers=36,
                     num_attention_heads=32, intermediate_size=12288,
                     tie_word_embeddings=False),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, rms_norm_eps=1e-5, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, hidden_act="silu", tie_word_embeddings=True,
        torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001,
        attention_bias=False, mlp_bias=False),
    "qwen3-30b-a3b": dict(
        _QWEN3_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        intermediate_size=6144, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False),
}


def resolve_model(model: str) -> tuple[str, bool]:
    """A model directory as given, or a preset name written to a temporary directory.
    Returns (directory, is_preset); presets have no weights, so they run with dummy ones."""
    if model not in PRESETS:
        return model, False
    out = Path(tempfile.mkdtemp(prefix=f"nanoserve-{model}-"))
    (out / "config.json").write_text(json.dumps(PRESETS[model], indent=2))
    return str(out), True
