"""Structured output on CUDA: the draw kernel's masked path against the torch path at Qwen3's
vocab, and constrained requests through CUDA graphs and async scheduling."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine_service import LLM, SamplingParams
from models.layers.sampler import Sampler, SamplingTensors, apply_token_bitmask
from tests.test_sample_kernel import assert_tokens_match, race_reference

DEVICE = torch.device("cuda")
VOCAB = 151936  # Qwen3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_masked_draw_kernel_matches_torch_path(dtype: torch.dtype) -> None:
    """Rows of every mask density, a row with one allowed token and greedy and sampled rows:
    the kernel reading the bitmask draws what the torch path draws from masked logits."""
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    num_rows = 64
    logits = (torch.randn(num_rows, VOCAB, generator=gen, device=DEVICE) * 4).to(dtype)
    keep = torch.rand(num_rows, VOCAB, generator=gen, device=DEVICE) < torch.linspace(
        0.001, 1.0, num_rows, device=DEVICE)[:, None]
    keep[0] = False
    keep[0, 12345] = True
    padded = torch.zeros(num_rows, -(-VOCAB // 32) * 32, dtype=torch.int64, device=DEVICE)
    padded[:, :VOCAB] = keep.long()
    words = (padded.view(num_rows, -1, 32) << torch.arange(32, device=DEVICE)).sum(-1)
    bitmask = words.to(torch.int32)  # bit 31 wraps to the sign, as xgrammar's masks hold it
    params = [SamplingParams(temperature=[0.0, 0.7, 1.0, 1.5][i % 4]) for i in range(num_rows)]
    t = SamplingTensors.build(params, list(range(num_rows)), [3] * num_rows, None, None, [],
                              VOCAB, DEVICE, any_token_mask=True)
    t.token_bitmask = bitmask
    got = Sampler()(logits, t).sampled_token_ids
    want = Sampler(use_kernel=False)(logits, t).sampled_token_ids
    assert keep.gather(1, got[:, None]).all(), "a masked token was drawn"
    assert got[0].item() == 12345
    masked = apply_token_bitmask(logits.float(), bitmask)
    _, near = race_reference(masked, t.temperatures, t.seeds, t.sample_steps)
    assert assert_tokens_match(got, want, near, "masked draw") <= 1


SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["n", "tags"]}


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_constrained_requests_on_cuda(tiny_model_dir, enforce_eager, async_scheduling):
    llm = LLM(str(tiny_model_dir), device="cuda", enforce_eager=enforce_eager,
              async_scheduling=async_scheduling, max_model_len=512, num_kv_blocks=64)
    kinds = [dict(json_schema=json.dumps(SCHEMA), max_tokens=80),
             dict(regex=r"[a-z]{2,5}-\d{3}", max_tokens=30),
             dict(choice=["alpha", "beta gamma"], max_tokens=20)]
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, **kinds[i % 3])
              for i in range(36)]
    try:
        outs = llm.generate([f"prompt {i}" for i in range(36)], params, use_tqdm=False)
        for i, out in enumerate(outs):
            assert out.finish_reason == "stop", (i, out.text)
            if i % 3 == 0:
                value = json.loads(out.text)
                assert 0 <= value["n"] <= 99 and set(value["tags"]) <= {"a", "b"}
            elif i % 3 == 1:
                assert re.fullmatch(r"[a-z]{2,5}-\d{3}", out.text), out.text
            else:
                assert out.text in ("alpha", "beta gamma")
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    finally:
        llm.engine.shutdown()
