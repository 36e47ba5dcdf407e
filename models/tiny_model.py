"""`nanoserve tiny-model DIR`: a small random Qwen3 checkpoint plus a real tokenizer.

The checkpoint is laid out exactly like a Hugging Face Qwen3 one (config.json,
generation_config.json, safetensors weights, tokenizer.json, tokenizer_config.json), so
both nanoserve and transformers load it. Same arguments -> byte-identical files.
torch and transformers are imported inside the functions: the CLI imports this module.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
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


def build_tokenizer(corpus: Sequence[str] = CORPUS,
                    vocab_size: int = TOKENIZER_VOCAB_SIZE) -> Any:
    """Byte-level BPE trained on `corpus`; special tokens get ids 0, 1, 2. Deterministic."""
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
    tokenizer: Any = None,
) -> Path:
    """Write a random Qwen3 checkpoint and `tokenizer` (a tokenizers.Tokenizer, default
    build_tokenizer()) into `out_dir`; returns its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer() if tokenizer is None else tokenizer
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="output directory (created if missing)")
    parser.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    path = make_tiny_model(args.dir, seed=args.seed)
    print(f"wrote a tiny random Qwen3 model and tokenizer to {path}")
    return 0
