"""The engine on a GPU: float32 tokens identical to transformers on the tiny model, CUDA
graphs identical to eager, and the Qwen3-0.6B shape in bf16 teacher-forced against
transformers on the same random weights."""

from __future__ import annotations

import json
import random

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.scheduler import ScheduledSeq
from engine_service.sequence import Sequence

MAX_TOKENS = 16


def _prompts(n: int, vocab: int, seed: int, lo: int = 1, hi: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hf_cpu(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_float32_greedy_matches_transformers(tiny_model_dir, hf_cpu, block_size, enforce_eager):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", kv_block_size=block_size,
              num_kv_blocks=4096 // block_size + 64, max_model_len=512,
              attention_backend="triton", enforce_eager=enforce_eager)
    prompts = _prompts(12, vocab, seed=block_size)
    # second pass hits the prefix cache
    for _ in range(2):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, outs, strict=True):
            with torch.no_grad():
                assert o.token_ids == _hf_greedy(hf_cpu, p, MAX_TOKENS)


def test_cuda_graphs_equal_eager(tiny_model_dir):
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    prompts = _prompts(37, vocab, seed=3)  # 37 rows: replays a padded graph
    results = []
    for eager in (True, False):
        llm = LLM(str(tiny_model_dir), device="cuda", dtype="float32", num_kv_blocks=2048,
                  max_model_len=512, enforce_eager=eager)
        assert (llm.engine.model_runner.graph_runner is None) == eager
        sp = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)
        results.append([o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        del llm
    assert results[0] == results[1]


@pytest.fixture(scope="module")
def qwen3_06b_dir(tmp_path_factory):
    """Qwen3-0.6B shape with random bf16 weights, saved by transformers."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from benchmarks.model_configs import PRESETS

    out = tmp_path_factory.mktemp("qwen3-0.6b")
    cfg = dict(PRESETS["qwen3-0.6b"])
    cfg.pop("architectures")
    cfg.pop("model_type")
    config = Qwen3Config(**cfg)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    # Wider random weights than the default init, so next-token choices are not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.05 if "embed" not in name else 0.5)
    model.save_pretrained(out)
    return out


def test_qwen3_06b_bf16_teacher_forced_argmax_agreement(qwen3_06b_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(qwen3_06b_dir, dtype=torch.bfloat16).cuda().eval()
    llm = LLM(str(qwen3_06b_dir), device="cuda", dtype="bfloat16", num_kv_blocks=2048,
              max_model_len=1024, enforce_eager=True)
    runner = llm.engine.model_runner
    prompts = _prompts(32, 10000, seed=11, lo=64, hi=256)
    agree = total = 0
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([p], device="cuda")).logits[0].argmax(-1)
        seq = Sequence(f"tf-{i}", p, SamplingParams())
        bm = llm.engine.block_manager
        bm.allocate(seq, len(p))
        try:
            with torch.inference_mode():
                ids, pos, meta, _ = runner.prepare_inputs([ScheduledSeq(seq, len(p), True)])
                hidden = runner.model(ids, pos, meta)
                ours = runner.model.compute_logits(hidden).argmax(-1)
        finally:
            bm.free(seq)
        agree += (ours == ref).sum().item()
        total += len(p)
    rate = agree / total
    print(f"bf16 teacher-forced argmax agreement: {rate:.4f} over {total} positions")
    assert rate >= 0.98
