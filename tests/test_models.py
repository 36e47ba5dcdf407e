"""Qwen3 on the paged KV cache (torch backend) against transformers on the same weights."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from models.attention_metadata import (
    AttentionMetadata,
    BlockTableCache,
    make_attention_metadata,
)
from models.backends import get_attention_backend
from models.backends.torch_backend import TorchAttentionBackend
from models.config import ModelConfig
from models.loader import init_dummy_weights, load_weights
from models.qwen3 import Qwen3ForCausalLM
from models.tiny_model import make_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 64
BAD_BLOCK = 10**6  # block-table padding: reading it would raise IndexError
ATOL = 1e-4


# ---------------------------------------------------------------- helpers


class Blocks:
    """A toy block allocator handing out blocks in a scrambled order."""

    def __init__(self, num_blocks: int = NUM_BLOCKS, seed: int = 0) -> None:
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.free = self.free.tolist()

    def take(self, n: int) -> list[int]:
        out, self.free = self.free[:n], self.free[n:]
        return out


@dataclasses.dataclass
class Row:
    tokens: list[int]  # the whole context after this step
    q_len: int  # this step computes the last q_len tokens
    blocks: list[int]


def build_model(model_dir: Path, with_cache: bool = True) -> Qwen3ForCausalLM:
    config = ModelConfig.from_dir(model_dir)
    model = Qwen3ForCausalLM(config, get_attention_backend("torch", "cpu")).eval()
    load_weights(model, model_dir)
    if with_cache:
        attach_cache(model)
    return model


def attach_cache(model: Qwen3ForCausalLM) -> None:
    for attn in model.attention_layers():
        # NaN, so a read of a slot nobody wrote poisons the logits.
        attn.kv_cache = torch.full(
            (2, NUM_BLOCKS, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim), float("nan"))


def run_step(model: Qwen3ForCausalLM, rows: list[Row],
             host_lists: bool = True) -> list[torch.Tensor]:
    """One flat batch; returns each row's logits [q_len, vocab]."""
    ids, positions = [], []
    for row in rows:
        start = len(row.tokens) - row.q_len
        ids += row.tokens[start:]
        positions += range(start, len(row.tokens))
    meta = make_attention_metadata([r.q_len for r in rows], [len(r.tokens) for r in rows],
                                   [r.blocks for r in rows], BLOCK_SIZE, pad_block_id=BAD_BLOCK)
    if not host_lists:
        meta = dataclasses.replace(meta, seq_lens_cpu=None, cu_seqlens_q_cpu=None)
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.tensor(positions), meta)
        logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    assert logits.shape == (len(ids), model.config.vocab_size)
    return list(logits.split([r.q_len for r in rows]))


def load_hf(model_dir: Path):
    # Imported here: the tensor-parallel workers import this module and do not need it.
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()  # [len, vocab]


def check_rows(hf_model, rows: list[Row], got: list[torch.Tensor]) -> None:
    for row, logits in zip(rows, got, strict=True):
        ref = hf_logits(hf_model, row.tokens)[len(row.tokens) - row.q_len:]
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=1e-4)


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_rows(vocab: int, blocks: Blocks) -> list[Row]:
    rows = []
    for i, n in enumerate((7, 13, 3)):
        # room for one more token each (the decode step below)
        rows.append(Row(random_tokens(n, vocab, seed=i), n, blocks.take(-(-(n + 1) // 4))))
    return rows


# Fixtures from conftest.py: tiny_model_dir (make_tiny_model(seed=0), session-wide) and
# hf_model (transformers' Qwen3ForCausalLM loaded from it in float32).


# ---------------------------------------------------------------- model vs transformers


def test_mixed_batches_match_transformers(tiny_model_dir, hf_model):
    model = build_model(tiny_model_dir)
    vocab = model.config.vocab_size
    blocks = Blocks()

    # Step 1: three prefills from scratch, different lengths, one batch.
    a, b, c = prefill_rows(vocab, blocks)
    step1 = [a, b, c]
    out1 = run_step(model, step1)
    check_rows(hf_model, step1, out1)

    # Step 2: a decode row for each, a prefix-cached prefill sharing b's first two (full)
    # blocks, and the first chunk of a chunked prefill.
    for row, logits in zip(step1, out1, strict=True):
        row.tokens.append(int(logits[-1].argmax()))
        row.q_len = 1
    d_tokens = b.tokens[:8] + random_tokens(6, vocab, seed=10)
    d = Row(d_tokens, q_len=6, blocks=b.blocks[:2] + blocks.take(2))
    e_tokens = random_tokens(11, vocab, seed=11)
    e_blocks = blocks.take(3)
    e = Row(e_tokens[:5], q_len=5, blocks=e_blocks)
    step2 = [a, d, b, e, c]
    check_rows(hf_model, step2, run_step(model, step2))

    # Step 3: the second chunk, next to decodes (one crossing into a new block).
    e = Row(e_tokens, q_len=6, blocks=e_blocks)
    d.tokens.append(int(random_tokens(1, vocab, seed=12)[0]))
    d.q_len = 1
    a.tokens.append(5)
    a.blocks += blocks.take(1)  # a: 9 tokens -> 3 blocks
    step3 = [e, d, a]
    check_rows(hf_model, step3, run_step(model, step3, host_lists=False))


def test_forward_without_cache_matches_cached_path(tiny_model_dir, hf_model):
    vocab = ModelConfig.from_dir(tiny_model_dir).vocab_size
    cached = build_model(tiny_model_dir)
    uncached = build_model(tiny_model_dir, with_cache=False)
    rows = prefill_rows(vocab, Blocks())
    got_cached = run_step(cached, rows)
    got_uncached = run_step(uncached, rows)
    for x, y in zip(got_cached, got_uncached, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    check_rows(hf_model, rows, got_uncached)


@pytest.mark.parametrize(("tie", "num_shards"), [(False, 1), (True, 3), (False, 3)])
def test_tied_untied_and_sharded_checkpoints(tmp_path, tie, num_shards):
    model_dir = make_tiny_model(tmp_path, seed=1, tie_word_embeddings=tie,
                                num_shards=num_shards)
    assert (model_dir / "model.safetensors.index.json").is_file() == (num_shards > 1)
    assert len(list(model_dir.glob("*.safetensors"))) == num_shards
    hf = load_hf(model_dir)
    model = build_model(model_dir)
    shared = model.lm_head.weight is model.model.embed_tokens.weight
    assert shared == tie
    if not tie:
        assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    rows = prefill_rows(model.config.vocab_size, Blocks(seed=3))
    check_rows(hf, rows, run_step(model, rows))


# ---------------------------------------------------------------- loader errors


def _rewrite_checkpoint(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_tensor_is_a_clear_error(tiny_model_dir, tmp_path):
    model_dir = _rewrite_checkpoint(
        tiny_model_dir, tmp_path / "m", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    model = Qwen3ForCausalLM(ModelConfig.from_dir(model_dir), TorchAttentionBackend())
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj"):
        load_weights(model, model_dir)


def test_unexpected_and_misshaped_tensors_are_clear_errors(tiny_model_dir, tmp_path):
    extra = _rewrite_checkpoint(
        tiny_model_dir, tmp_path / "extra",
        lambda t: t.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(128, 64)}))
    model = Qwen3ForCausalLM(ModelConfig.from_dir(extra), TorchAttentionBackend())
    with pytest.raises(ValueError, match=r"unexpected tensors: model\.layers\.7\.mlp\.up_proj"):
        load_weights(model, extra)

    bad = _rewrite_checkpoint(
        tiny_model_dir, tmp_path / "bad",
        lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 100)}))
    with pytest.raises(ValueError, match=r"down_proj\.weight.*shape \[64, 100\]"):
        load_weights(model, bad)


def test_no_weights_is_a_clear_error(tiny_model_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    model = Qwen3ForCausalLM(ModelConfig.from_dir(tmp_path), TorchAttentionBackend())
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_weights(model, tmp_path)


def test_dummy_weights_are_seeded(tiny_model_dir):
    config = ModelConfig.from_dir(tiny_model_dir)
    m1 = Qwen3ForCausalLM(config, TorchAttentionBackend())
    m2 = Qwen3ForCausalLM(config, TorchAttentionBackend())
    init_dummy_weights(m1, seed=3)
    init_dummy_weights(m2, seed=3)
    for (name, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters(), strict=True):
        assert torch.equal(p1, p2), name
        assert torch.isfinite(p1).all()
    norm = m1.model.layers[0].self_attn.q_norm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    w = m1.model.layers[0].mlp.down_proj.weight
    # uniform(-1e-3, 1e-3): std 1e-3 / sqrt(3)
    assert w.abs().max().item() <= 1e-3 and 5e-4 < w.std().item() < 6.5e-4


# ---------------------------------------------------------------- backend pieces


def test_store_kv_skips_slot_minus_one():
    backend = TorchAttentionBackend()
    kv_cache = torch.zeros(2, 3, 4, 2, 8)  # 3 blocks of 4 slots
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    backend.store_kv(key, value, kv_cache, torch.tensor([9, -1, 2]))
    flat = kv_cache.view(2, 12, 2, 8)
    assert torch.equal(flat[0, 9], key[0]) and torch.equal(flat[1, 9], value[0])
    assert torch.equal(flat[0, 2], key[2]) and torch.equal(flat[1, 2], value[2])
    written = torch.zeros(12, dtype=torch.bool)
    written[[9, 2]] = True
    assert not flat[:, ~written].any()  # token 1 went nowhere


def test_paged_attention_matches_dense_softmax():
    """The backend against attention written out by hand (GQA, query offset)."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, dim, block_size = 4, 2, 8, 4
    seq_len, q_len, scale = 10, 3, 0.3
    k_all, v_all = torch.randn(seq_len, num_kv_heads, dim), torch.randn(seq_len, num_kv_heads, dim)
    query = torch.randn(q_len, num_heads, dim)
    kv_cache = torch.full((2, 5, block_size, num_kv_heads, dim), float("nan"))
    table = [4, 0, 2]
    meta = make_attention_metadata([seq_len], [seq_len], [table], block_size)
    backend = TorchAttentionBackend()
    backend.store_kv(k_all, v_all, kv_cache, meta.slot_mapping)
    meta = make_attention_metadata([q_len], [seq_len], [table], block_size)
    out = backend.forward(query, kv_cache, meta, scale)
    for i in range(q_len):
        pos = seq_len - q_len + i
        for h in range(num_heads):
            kv = h // (num_heads // num_kv_heads)
            scores = (k_all[: pos + 1, kv] @ query[i, h]) * scale
            expect = torch.softmax(scores, 0) @ v_all[: pos + 1, kv]
            torch.testing.assert_close(out[i, h], expect, atol=1e-5, rtol=1e-5)


def test_backend_selection():
    assert get_attention_backend("torch", torch.device("cpu")).name == "torch"
    assert get_attention_backend("auto", "cpu").name == "torch"
    with pytest.raises(ValueError, match="attention_backend='triton' needs a CUDA device"):
        get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        get_attention_backend("fast", "cpu")


def test_metadata_validation():
    meta = make_attention_metadata([2, 1], [2, 5], [[0], [1, 2]], 4)
    assert meta.slot_mapping.tolist() == [0, 1, 2 * 4 + 0]
    assert meta.cu_seqlens_q.tolist() == [0, 2, 3] and not meta.decode_only
    with pytest.raises(ValueError, match="seq_lens must have shape"):
        dataclasses.replace(meta, seq_lens=torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ValueError, match="slot_mapping must be a 1-D int64"):
        AttentionMetadata(torch.zeros(3, dtype=torch.int32), meta.cu_seqlens_q, meta.seq_lens,
                          meta.block_tables, 2, 5)


def _padded(tables: list[list[int]], pad: int) -> list[list[int]]:
    width = max((len(t) for t in tables), default=0)
    return [t + [pad] * (width - len(t)) for t in tables]


def _slots(query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
           block_size: int) -> list[int]:
    """Slot of every query token, written out position by position."""
    return [tables[b][pos // block_size] * block_size + pos % block_size
            for b, (q, n) in enumerate(zip(query_lens, seq_lens, strict=True))
            for pos in range(n - q, n)]


def test_block_table_cache_equals_fresh_tables():
    """Tables packed through a cache kept across calls equal plain padded lists after every
    kind of change: growth, an in-place edit of the same length, clear and refill, a new
    list with equal contents, rows dropped and reordered, an empty batch."""
    cache, pad = BlockTableCache(), 7
    a, b, c = [3, 4], [5], [8, 9, 10]
    batches = [
        [a, b, c],
        [a, b, c],  # unchanged: every row reused
        [c, a, b],  # reordered
        "grow",  # a and b gain a block
        "edit",  # a block id changes in place, same length
        "refill",  # b freed (preempted) and refilled with other blocks, same length
        [list(a), c],  # a copy of a (a new list object), b dropped
        [],
        [b, a],
    ]
    for batch in batches:
        if batch == "grow":
            a.append(11)
            b.append(12)
            batch = [a, b, c]
        elif batch == "edit":
            a[1] = 13
            batch = [a, b, c]
        elif batch == "refill":
            n = len(b)
            b.clear()
            b.extend(range(20, 20 + n))
            batch = [a, b, c]
        packed = cache.pack(batch, max(map(len, batch), default=0), pad)
        assert packed.dtype == np.int32
        assert packed.tolist() == _padded(batch, pad)
        if batch:  # the same through the metadata, slots included
            seq_lens = [len(t) * BLOCK_SIZE for t in batch]
            query_lens = [1] * len(batch)
            meta = make_attention_metadata(query_lens, seq_lens, batch, BLOCK_SIZE,
                                           pad_block_id=pad, table_cache=cache)
            assert meta.block_tables.tolist() == _padded(batch, pad)
            assert meta.slot_mapping.tolist() == _slots(query_lens, seq_lens, batch,
                                                        BLOCK_SIZE)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 3, 1], [2, 1, 4]])
def test_slot_mapping_matches_positions(query_lens):
    """Decode-only batches take a shorter path to the slots than mixed ones; both must put
    every query token at its position's slot."""
    seq_lens = [5, 9, 4]
    tables = [[6, 2], [0, 5, 1], [3]]
    meta = make_attention_metadata(query_lens, seq_lens, tables, BLOCK_SIZE)
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == _slots(query_lens, seq_lens, tables, BLOCK_SIZE)
    assert meta.decode_only == all(q == 1 for q in query_lens)
    assert meta.max_query_len == max(query_lens)


def test_vocab_shards_pad_the_last_rank(monkeypatch):
    """vocab 10 over 3 ranks: rows 0-3, 4-7, 8-9 (+2 zero rows); shards read lazily."""
    import models.layers.embedding as embedding

    full = torch.randn(10, 4)
    shards = []
    for rank in range(3):
        monkeypatch.setattr(embedding, "get_tp_rank", lambda r=rank: r)
        monkeypatch.setattr(embedding, "get_tp_size", lambda: 3)
        layer = embedding.VocabParallelEmbedding(10, 4)
        layer.weight.weight_loader(layer.weight, full)
        shards.append(layer.weight.detach().clone())
    assert all(s.shape == (4, 4) for s in shards)
    torch.testing.assert_close(torch.cat(shards)[:10], full, atol=0, rtol=0)
    assert not shards[2][2:].any()


# ---------------------------------------------------------------- config


def test_config_from_dir(tmp_path, tiny_model_dir):
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    config = ModelConfig.from_dir(tiny_model_dir)
    assert config.head_dim == raw["head_dim"] and config.rope_theta == raw["rope_theta"]
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert config.eos_token_id[0] == raw["eos_token_id"]
    assert set(config.eos_token_id) == {raw["eos_token_id"], *gen["eos_token_id"]}

    # Llama/Qwen2 style: no head_dim, rope under rope_parameters (transformers 5).
    llama = {k: v for k, v in raw.items() if k not in ("head_dim", "rope_theta")}
    llama.update(hidden_size=96, num_attention_heads=4, eos_token_id=3,
                 rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    (tmp_path / "config.json").write_text(json.dumps(llama))
    config = ModelConfig.from_dir(tmp_path)
    assert config.head_dim == 24 and config.rope_theta == 5e5
    assert config.eos_token_id == [3]

    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        dataclasses.replace(config, num_key_value_heads=3)
    with pytest.raises(ValueError, match="eos_token_id"):
        dataclasses.replace(config, eos_token_id=[10**6])


# ---------------------------------------------------------------- tensor parallel (gloo)


def _tp_worker(rank: int, world_size: int, model_dir: str, init_file: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        model = build_model(Path(model_dir))
        vocab = model.config.vocab_size
        rows = prefill_rows(vocab, Blocks())
        out1 = run_step(model, rows)
        for row, logits in zip(rows, out1, strict=True):
            row.tokens.append(int(logits[-1].argmax()))
            row.q_len = 1
        out2 = run_step(model, rows)
        result = {"tokens": [r.tokens for r in rows], "step1": out1, "step2": out2,
                  "kv_heads": model.attention_layers()[0].num_kv_heads}
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_matches_transformers(tiny_model_dir, hf_model, tmp_path, world_size):
    """TP=2 splits KV heads (2 -> 1 per rank); TP=4 replicates them (2 heads, 4 ranks)."""
    import torch.multiprocessing as mp

    out = str(tmp_path / "result")
    mp.spawn(_tp_worker, args=(world_size, str(tiny_model_dir), str(tmp_path / "init"), out),
             nprocs=world_size, join=True)
    results = [torch.load(f"{out}.{r}") for r in range(world_size)]
    assert results[0]["kv_heads"] == 1
    for res in results:  # every rank gets the full, identical logits
        assert res["tokens"] == results[0]["tokens"]
        for tokens, l1, l2 in zip(res["tokens"], res["step1"], res["step2"], strict=True):
            ref = hf_logits(hf_model, tokens)
            torch.testing.assert_close(l1, ref[:-1], atol=ATOL, rtol=1e-4)
            torch.testing.assert_close(l2, ref[-1:], atol=ATOL, rtol=1e-4)
