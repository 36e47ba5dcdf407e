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
    # GSAI-ML/LLaDA-8B-Instruct's config.json: OLMo-style keys (configuration_llada.py), as
    # models/config.py reads them; its Llama block is the one setting of each switch it runs.
    "llada-8b": dict(
        architectures=["LLaDAModelLM"], model_type="llada", d_model=4096, n_layers=32,
        n_heads=32, n_kv_heads=32, multi_query_attention=None, mlp_hidden_size=12288,
        mlp_ratio=4, vocab_size=126464, embedding_size=126464, mask_token_id=126336,
        eos_token_id=126081, pad_token_id=126081, max_sequence_length=4096,
        rope_theta=500000.0, rope=True, rope_full_precision=True, rms_norm_eps=1e-5,
        activation_type="silu", block_type="llama", block_group_size=1,
        layer_norm_type="rms", layer_norm_with_affine=True, bias_for_layer_norm=False,
        attention_layer_norm=False, attention_layer_norm_with_affine=True, alibi=False,
        alibi_bias_max=8.0, include_bias=False, include_qkv_bias=False, input_emb_norm=False,
        scale_logits=False, weight_tying=False, attention_dropout=0.0, embedding_dropout=0.0,
        residual_dropout=0.0, flash_attention=False, init_device="meta", init_fn="mitchell",
        init_std=0.02, init_cutoff_factor=None, precision="amp_bf16", use_cache=False,
        torch_dtype="bfloat16"),
}


def resolve_model(model: str, tokenizer: bool = False) -> tuple[str, bool]:
    """A model directory as given, or a preset name written to a temporary directory.
    Returns (directory, is_preset); presets have no weights, so they run with dummy ones,
    and no tokenizer unless asked for (`write_bench_tokenizer`)."""
    if model not in PRESETS:
        return model, False
    out = Path(tempfile.mkdtemp(prefix=f"nanoserve-{model}-"))
    config = PRESETS[model]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer:
        write_bench_tokenizer(out, config["vocab_size"], config["eos_token_id"])
    return str(out), True


def _byte_chars() -> list[str]:
    """The byte-level BPE alphabet: byte b -> a printable character (GPT-2's mapping)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _bench_token(rng) -> str:
    """A token as BPE vocabularies hold them: mostly word pieces (a third after a space),
    some digit groups of up to 3 (as Llama 3 and Qwen split numbers), some punctuation."""
    kind = rng.random()
    if kind < 0.85:
        word = "".join(rng.choice("etaoinshrdlucmfwypvbgkqjxz") for _ in range(rng.randint(2, 9)))
        word = word.capitalize() if rng.random() < 0.2 else word
        return (" " if rng.random() < 0.33 else "") + word
    if kind < 0.9:
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
    return "".join(rng.choice("\"'{}[](),.:;-_/!?<>=#") for _ in range(rng.randint(1, 3)))


def write_bench_tokenizer(out: Path, vocab_size: int, eos_token_id: int, seed: int = 0) -> None:
    """A byte-level BPE tokenizer of `vocab_size` tokens: the 256 bytes, then random
    `_bench_token`s, so structured output's masks cost about what they cost on a real
    vocabulary of that size."""
    import random

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_chars()
    rng = random.Random(seed)
    vocab = {c: i for i, c in enumerate(chars)}
    while len(vocab) < vocab_size:
        text = "".join(chars[b] for b in _bench_token(rng).encode())
        vocab.setdefault(text, len(vocab))
    eos = next(t for t, i in vocab.items() if i == eos_token_id)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(eos, special=True)])
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}))
