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
}


def resolve_model(model: str) -> tuple[str, bool]:
    """A model directory as given, or a preset name written to a temporary directory.
    Returns (directory, is_preset); presets have no weights, so they run with dummy ones."""
    if model not in PRESETS:
        return model, False
    out = Path(tempfile.mkdtemp(prefix=f"nanoserve-{model}-"))
    (out / "config.json").write_text(json.dumps(PRESETS[model], indent=2))
    return str(out), True
