"""Test-only checkpoint writers: tiny random LLaDA and Dream checkpoints in their published
formats (weights and config.json only), and a tokenizer with JSON merges for structured
output. Same arguments -> byte-identical files."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from models.tiny_model import CORPUS, _remove_old_weights, _save, _write_json, build_tokenizer


def json_corpus(n: int = 8000, seed: int = 0) -> list[str]:
    """n compact JSON records (camelCase keys, words, numbers, nesting) made from CORPUS's
    words: enough frequent pairs for a few thousand merges, JSON punctuation among them."""
    rng = random.Random(seed)
    words = sorted({w.strip(".,!?:;()").lower() for t in CORPUS for w in t.split()})
    words = [w for w in words if w.isalpha()]
    keys = words + sorted({rng.choice(words) + rng.choice(words).capitalize()
                           for _ in range(1500)})

    def value(depth: int) -> Any:
        kind = rng.randrange(7 if depth < 2 else 5)
        if kind == 0:
            return rng.randrange(-1000, 100000)
        if kind == 1:
            return rng.choice([True, False, None])
        if kind == 2:
            return round(rng.uniform(-100, 100), rng.randrange(1, 4))
        if kind in (3, 4):
            return " ".join(rng.choices(words, k=rng.randint(1, 4)))
        if kind == 5:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return record(depth + 1)

    def record(depth: int = 0) -> dict:
        return {rng.choice(keys): value(depth) for _ in range(rng.randint(1, 4))}

    return [json.dumps(record(), separators=(",", ":")) for _ in range(n)]


def json_tokenizer(vocab_size: int) -> Any:
    """make_tiny_model's BPE trained on CORPUS and json_corpus() up to `vocab_size` tokens."""
    return build_tokenizer(CORPUS + json_corpus(), vocab_size)


# Tiny diffusion vocabularies: 128 ordinary ids (the last one eos) and the mask token after them.
DIFFUSION_VOCAB_SIZE = 129
DIFFUSION_MASK_TOKEN_ID = 128
DIFFUSION_EOS_TOKEN_ID = 127


def _random_tensors(shapes: dict[str, tuple[int, ...]], seed: int,
                    weight_std: float) -> dict[str, Any]:
    """A float32 tensor per name from a seeded generator (sorted names: same seed, same
    bytes): norm weights ~ 1 + N(0, 0.1) (a misplaced norm shows), the rest ~ N(0, std)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        noise = torch.randn(shapes[name], generator=gen, dtype=torch.float32)
        is_norm = name.endswith("norm.weight") or name.endswith("ln_f.weight")
        tensors[name] = 1.0 + 0.1 * noise if is_norm else weight_std * noise
    return tensors


def _write_diffusion_checkpoint(out_dir: str | Path, config: dict,
                                shapes: dict[str, tuple[int, ...]], seed: int,
                                weight_std: float) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(out_dir)
    _save(_random_tensors(shapes, seed, weight_std), out_dir / "model.safetensors")
    _write_json(out_dir / "config.json", config)
    return out_dir


def make_tiny_llada(
    out_dir: str | Path,
    seed: int = 0,
    *,
    d_model: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 4,
    n_layers: int = 2,
    mlp_hidden_size: int = 96,
    embedding_size: int = 256,
    include_qkv_bias: bool = False,
    weight_tying: bool = False,
    weight_std: float = 0.2,
) -> Path:
    """A random LLaDA checkpoint (no tokenizer) as GSAI-ML/LLaDA-8B-* publish theirs: their
    config.json keys (configuration_llada.py's names) and tensor names (modeling_llada.py's
    LLaDALlamaBlock under `model.transformer`). The vocabulary is DIFFUSION_VOCAB_SIZE ids with
    the mask token last; embedding_size pads it, as LLaDA allows."""
    head_dim = d_model // n_heads
    config = {
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        },
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": d_model,
        "embedding_dropout": 0.0,
        "embedding_size": embedding_size,
        "eos_token_id": DIFFUSION_EOS_TOKEN_ID,
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": include_qkv_bias,
        "init_cutoff_factor": None,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": weight_std,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": DIFFUSION_MASK_TOKEN_ID,
        "max_sequence_length": 256,
        "mlp_hidden_size": mlp_hidden_size,
        "mlp_ratio": 4,
        "model_type": "llada",
        "multi_query_attention": None,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "n_layers": n_layers,
        "pad_token_id": DIFFUSION_EOS_TOKEN_ID,
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "torch_dtype": "float32",
        "use_cache": False,
        "vocab_size": DIFFUSION_VOCAB_SIZE,
        "weight_tying": weight_tying,
    }
    top = "model.transformer."
    shapes: dict[str, tuple[int, ...]] = {
        f"{top}wte.weight": (embedding_size, d_model),
        f"{top}ln_f.weight": (d_model,),
    }
    if not weight_tying:
        shapes[f"{top}ff_out.weight"] = (embedding_size, d_model)
    qkv_out = {"q_proj": d_model, "k_proj": n_kv_heads * head_dim, "v_proj": n_kv_heads * head_dim}
    for i in range(n_layers):
        block = f"{top}blocks.{i}."
        shapes |= {
            f"{block}attn_norm.weight": (d_model,),
            f"{block}ff_norm.weight": (d_model,),
            f"{block}attn_out.weight": (d_model, d_model),
            f"{block}ff_proj.weight": (mlp_hidden_size, d_model),  # the SiLU gate
            f"{block}up_proj.weight": (mlp_hidden_size, d_model),
            f"{block}ff_out.weight": (d_model, mlp_hidden_size),
        }
        for proj, width in qkv_out.items():
            shapes[f"{block}{proj}.weight"] = (width, d_model)
            if include_qkv_bias:
                shapes[f"{block}{proj}.bias"] = (width,)
    return _write_diffusion_checkpoint(out_dir, config, shapes, seed, weight_std)


def make_tiny_dream(
    out_dir: str | Path,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    num_hidden_layers: int = 2,
    intermediate_size: int = 96,
    tie_word_embeddings: bool = False,
    weight_std: float = 0.2,
) -> Path:
    """A random Dream checkpoint (no tokenizer) as Dream-org/Dream-v0-* publish theirs:
    their config.json keys (configuration_dream.py's DreamConfig) and Qwen2's tensor names.
    The vocabulary is DIFFUSION_VOCAB_SIZE ids with the mask token last."""
    head_dim = hidden_size // num_attention_heads
    config = {
        "architectures": ["DreamModel"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_dream.DreamConfig",
            "AutoModel": "modeling_dream.DreamModel",
        },
        "bos_token_id": DIFFUSION_EOS_TOKEN_ID,
        "eos_token_id": DIFFUSION_EOS_TOKEN_ID,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": weight_std,
        "intermediate_size": intermediate_size,
        "mask_token_id": DIFFUSION_MASK_TOKEN_ID,
        "max_position_embeddings": 256,
        "max_window_layers": num_hidden_layers,
        "model_type": "Dream",
        "num_attention_heads": num_attention_heads,
        "num_hidden_layers": num_hidden_layers,
        "num_key_value_heads": num_key_value_heads,
        "pad_token_id": DIFFUSION_EOS_TOKEN_ID,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": DIFFUSION_VOCAB_SIZE,
    }
    kv_width = num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (DIFFUSION_VOCAB_SIZE, hidden_size),
        "model.norm.weight": (hidden_size,),
    }
    if not tie_word_embeddings:
        shapes["lm_head.weight"] = (DIFFUSION_VOCAB_SIZE, hidden_size)
    for i in range(num_hidden_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            f"{layer}input_layernorm.weight": (hidden_size,),
            f"{layer}post_attention_layernorm.weight": (hidden_size,),
            f"{layer}self_attn.q_proj.weight": (hidden_size, hidden_size),
            f"{layer}self_attn.q_proj.bias": (hidden_size,),
            f"{layer}self_attn.k_proj.weight": (kv_width, hidden_size),
            f"{layer}self_attn.k_proj.bias": (kv_width,),
            f"{layer}self_attn.v_proj.weight": (kv_width, hidden_size),
            f"{layer}self_attn.v_proj.bias": (kv_width,),
            f"{layer}self_attn.o_proj.weight": (hidden_size, hidden_size),
            f"{layer}mlp.gate_proj.weight": (intermediate_size, hidden_size),
            f"{layer}mlp.up_proj.weight": (intermediate_size, hidden_size),
            f"{layer}mlp.down_proj.weight": (hidden_size, intermediate_size),
        }
    return _write_diffusion_checkpoint(out_dir, config, shapes, seed, weight_std)
