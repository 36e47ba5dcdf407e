"""`nanoserve tiny-model DIR`: a small random Qwen3 checkpoint plus a real tokenizer.

The checkpoint is laid out exactly like a Hugging Face Qwen3 one (config.json,
generation_config.json, safetensors weights, tokenizer.json, tokenizer_config.json), so
both nanoserve and transformers load it. Same arguments -> byte-identical files.
`make_tiny_llada` and `make_tiny_dream` write the diffusion LLMs' published formats the same
way (weights and config.json only).
torch and transformers are imported inside the functions: the CLI imports this module.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]
TOKENIZER_VOCAB_SIZE = 512

# Qwen-style ChatML.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Training text for the byte-level BPE (written for this file).
CORPUS = [
    "The quick brown fox jumps over the lazy dog. A small model can still say many things, "
    "but it says most of them at random. Hello, world! How are you today? I am fine, thank "
    "you, and I hope that you are well too.",
    "Once upon a time there was a little server that answered every question it was asked. "
    "It kept a cache of the words it had already read, so when the same story came back it "
    "could skip the beginning and go straight to the end. The other servers thought this was "
    "a very good idea, and soon they all did the same.",
    "A language model reads a sequence of tokens and predicts the next one. Each token is a "
    "piece of text: a word, part of a word, a number or a sign like a comma. The model looks "
    "at all the tokens before it, adds them up in many layers, and writes out a score for "
    "every token in its vocabulary. The highest score wins when we decode greedily.",
    "In the morning the city is quiet. People walk to work, buses stop at the corner, and the "
    "smell of fresh bread comes from the bakery on the main street. By noon the streets are "
    "full and loud; in the evening the lights come on one by one, and the river turns gold "
    "under the bridge.",
    "Numbers are words too: one, two, three, four, five, six, seven, eight, nine and ten. "
    "Write 0 1 2 3 4 5 6 7 8 9, then 10, 20, 100 and 1024. Twelve months make a year, seven "
    "days make a week, and sixty minutes make an hour.",
    "Questions and answers: What is the capital of France? Paris is the capital of France. "
    "Why is the sky blue? Because the air scatters blue light more than red light. Where do "
    "you want to go? I would like to go home, have some tea and read a good book.",
    "To make a cup of tea, boil the water, put the tea in a warm pot and wait for three or "
    "four minutes. Then pour it into a cup, add milk or lemon if you like, and drink it "
    "while it is still hot. Some people like to eat a cake or a biscuit with their tea.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n",
    "The weather changes with the seasons. In spring the trees turn green and the birds come "
    "back; in summer the days are long and warm; in autumn the leaves fall and the wind gets "
    "colder; in winter it snows, and the children build a snowman in the garden.",
    "She opened the door, looked at the rain and decided to stay inside. There was a letter "
    "on the table from her brother, who lived by the sea. He wrote that the boats were "
    "ready, the nets were mended, and that everyone was waiting for her to visit this summer.",
    "Please be kind to each other. Share what you have, listen before you speak, and say "
    "thank you when someone helps you. These are simple rules, but they make the world a "
    "better place for everyone who lives in it.",
]


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


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Any:
    """Byte-level BPE trained on CORPUS, and on json_corpus() too for a vocabulary larger than
    the default (whose merges stay exactly as they are); special tokens get ids 0, 1, 2.
    Deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())  # byte-level: every string is encodable, no unk
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = CORPUS if vocab_size <= TOKENIZER_VOCAB_SIZE else CORPUS + json_corpus()
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def _hf_config(vocab_size: int, ids: dict[str, int], weight_std: float, **shape: Any) -> dict:
    """config.json; `shape`: make_tiny_model's size arguments, under their HF names."""
    return {
        **shape,
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": ids[IM_END],
        "hidden_act": "silu",
        "initializer_range": weight_std,
        "max_window_layers": shape["num_hidden_layers"],
        "model_type": "qwen3",
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def _random_state_dict(config: dict, seed: int, weight_std: float) -> dict:
    """transformers' Qwen3ForCausalLM filled from a seeded generator: weights ~ N(0, std)
    (peaked distributions, so greedy decoding survives float32 summation order), norm weights
    ~ 1 + N(0, 0.1) (so a misplaced norm shows)."""
    import torch
    from transformers import Qwen3Config as HFQwen3Config
    from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

    model = HFQwen3ForCausalLM(HFQwen3Config(**config)).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # tied lm_head comes once
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(weight_std * noise)
    state = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    return state


def _save(tensors: dict, path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates 0600 files; other users (pods) must read them


def _save_weights(state: dict, out_dir: Path, num_shards: int) -> None:
    names = sorted(state)
    if not 1 <= num_shards <= len(names):
        raise ValueError(f"num_shards must be in [1, {len(names)}], got {num_shards}")
    if num_shards == 1:
        _save(state, out_dir / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    per_shard = -(-len(names) // num_shards)
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = names[i * per_shard:(i + 1) * per_shard]
        _save({n: state[n] for n in chunk}, out_dir / file)
        weight_map.update(dict.fromkeys(chunk, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out_dir / "model.safetensors.index.json", index)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _remove_old_weights(out_dir: Path) -> None:
    # A previous run with another num_shards would leave files the loader also picks up.
    for old in [*out_dir.glob("model-*-of-*.safetensors"), out_dir / "model.safetensors",
                out_dir / "model.safetensors.index.json"]:
        if old.is_file():
            old.unlink()


def make_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
    num_shards: int = 1,
    weight_std: float = 0.2,
    tokenizer_vocab_size: int = TOKENIZER_VOCAB_SIZE,
) -> Path:
    """Write a random Qwen3 checkpoint and tokenizer into `out_dir`; returns its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(tokenizer_vocab_size)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = _hf_config(
        vocab_size, ids, weight_std, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings)
    state = _random_state_dict(config, seed, weight_std)

    _remove_old_weights(out_dir)
    _save_weights(state, out_dir, num_shards)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids[ENDOFTEXT],
        "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
        "pad_token_id": ids[ENDOFTEXT],
    })
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })
    return out_dir


# ---------------------------------------------------------------- diffusion LLMs

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2, help="num_hidden_layers")
    parser.add_argument("--heads", type=int, default=4, help="num_attention_heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="num_key_value_heads")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--max-position-embeddings", type=int, default=2048)
    parser.add_argument("--untied", action="store_true",
                        help="separate lm_head weights instead of tied embeddings")
    parser.add_argument("--num-shards", type=int, default=1,
                        help="number of safetensors files (>1 writes an index)")
    parser.add_argument("--weight-std", type=float, default=0.2)


def main(args: argparse.Namespace) -> int:
    path = make_tiny_model(
        args.dir, seed=args.seed, hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=not args.untied, num_shards=args.num_shards,
        weight_std=args.weight_std)
    print(f"wrote a tiny random Qwen3 model and tokenizer to {path}")
    return 0
