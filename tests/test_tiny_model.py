"""The tiny-model maker: files transformers can load, a working tokenizer, determinism."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models import tiny_model
from models.tiny_model import make_tiny_model

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Zebra quartz vexing jumbled pixies: 3.14159 × 2 = 6.28318",
    "  leading spaces, tabs\tand\nnew lines  ",
    "Ünïcödé, 日本語, emoji 🙂 — all bytes round-trip.",
]


def test_tokenizer_round_trip(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert len(tok) == config["vocab_size"]
    assert 400 <= len(tok) <= 600
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids and max(ids) < len(tok)
        assert tok.decode(ids) == text
    # Common words were learned as merges, not spelled byte by byte.
    assert len(tok.encode(TEXTS[0], add_special_tokens=False)) < 0.6 * len(TEXTS[0])
    # Every id is a token of the vocabulary (the model can emit any of them).
    assert None not in tok.convert_ids_to_tokens(list(range(len(tok))))
    assert tok.convert_ids_to_tokens([len(tok)]) == [None]  # the check can fail


def test_special_tokens_and_eos(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    im_start, im_end, eot = (tok.convert_tokens_to_ids(t)
                             for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == im_end
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == eot
    assert config["eos_token_id"] == im_end
    assert set(gen["eos_token_id"]) == {im_end, eot}
    ids = tok.encode("hi<|im_end|>", add_special_tokens=False)
    assert ids[-1] == im_end
    assert tok.decode(ids, skip_special_tokens=True) == "hi"
    assert len({im_start, im_end, eot}) == 3


def test_chat_template(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHello?<|im_end|>\n<|im_start|>assistant\n")
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == text[: -len("<|im_start|>assistant\n")]


def test_transformers_loads_every_weight(tiny_model_dir):
    model, info = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_next_token_distributions_are_not_flat(tiny_model_dir):
    """Greedy decoding must not hinge on float32 summation order: top-1/top-2 logit gaps
    are far above float32 noise (~1e-5 here) almost everywhere."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ids = tok.encode(" ".join(TEXTS), add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median() > 1e-2
    assert (gaps > 1e-3).float().mean() > 0.9


def _digest(model_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


def test_deterministic(tmp_path):
    a = _digest(make_tiny_model(tmp_path / "a", seed=5))
    b = _digest(make_tiny_model(tmp_path / "b", seed=5))
    assert a.keys() == b.keys()
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= a.keys()
    for name in a:
        assert a[name] == b[name], name
    c = _digest(make_tiny_model(tmp_path / "c", seed=6))
    assert c["model.safetensors"] != a["model.safetensors"]
    assert c["tokenizer.json"] == a["tokenizer.json"]


def test_cli_writes_the_seeded_model(tmp_path):
    parser = argparse.ArgumentParser()
    tiny_model.add_arguments(parser)
    assert tiny_model.main(parser.parse_args([str(tmp_path / "cli"), "--seed", "2"])) == 0
    assert _digest(tmp_path / "cli") == _digest(make_tiny_model(tmp_path / "api", seed=2))


def test_sharded_untied_model_loads_and_a_rewrite_leaves_no_stale_shard(tmp_path):
    make_tiny_model(tmp_path, seed=2, tie_word_embeddings=False, num_shards=2)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert "lm_head.weight" in index["weight_map"]
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]

    # Re-writing into the same directory with one shard leaves no stale shard files.
    make_tiny_model(tmp_path, seed=2)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
